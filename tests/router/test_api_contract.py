"""The API honors everything it accepts: every request field of the OpenAI API is served, refused with 400
naming it, or output-neutral (listed in one place) -- walked from the ``openai`` SDK's own request types,
so a field a new SDK adds fails here until it is classified.  Plus ``/tokenize``, ``/detokenize``,
``/version`` and the docs page."""

from __future__ import annotations

import json
import typing
from collections.abc import Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import grpc
import pytest
from fastapi.testclient import TestClient
from openai.types import completion_create_params
from openai.types.chat import completion_create_params as chat_create_params
from pydantic import ValidationError

from engine.hashing import MAX_CACHE_SALT_LEN
from router.auth import OPEN, Access, Caller, Tenant, key_digest
from router.http_gate import HttpGate
from router.openai_api import create_app
from router.openai_errors import ApiError
from router.openai_requests import chat_request, completion_request
from router.openai_schema import (
    NOT_SERVED,
    OUTPUT_NEUTRAL,
    ChatCompletionRequest,
    CompletionRequest,
)
from router.tokenizer import RouterModel, load_model
from telemetry.exposition import RpcCounters
from tests.gguf_models import write_gguf
from tests.tiny_models import pdkv_tiny_model_dir

CHAT = {"model": "tiny-chat", "messages": [{"role": "user", "content": "Hi"}]}
TEXT = {"model": "tiny-chat", "prompt": "Hi"}

# A value that asks for something, per not-served field (anything but its "off" value).
ASKING: dict[str, Any] = {
    "n": 2,
    "best_of": 2,
    "presence_penalty": 0.5,
    "frequency_penalty": -0.5,
    "logit_bias": {"5": -100},
    "top_logprobs": 3,
    "echo": True,
    "suffix": "tail",
    "guided_json": {"type": "object"},
    "guided_regex": "a+",
    "guided_choice": ["a", "b"],
    "guided_grammar": 'start: "a"',
    "guided_decoding_backend": "xgrammar",
    "functions": [{"name": "f"}],
    "function_call": "auto",
    "audio": {"voice": "alloy", "format": "wav"},
    "modalities": ["text", "audio"],
    "prediction": {"type": "content", "content": "x"},
    "reasoning_effort": "high",
    "verbosity": "low",
    "web_search_options": {},
    "moderation": {"model": "x"},
}


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> RouterModel:
    path: Path = tmp_path_factory.mktemp("contract") / "tiny-chat.gguf"
    return load_model(write_gguf(pdkv_tiny_model_dir(), path, qtype="F32"))


@pytest.fixture(scope="module")
def http(model: RouterModel) -> TestClient:
    # Nothing here reaches the pipeline: every request below is answered before admission runs it.
    pipeline: Any = SimpleNamespace(max_inflight=1)
    return TestClient(create_app(pipeline, model, healthy=lambda: True))


def _sdk_fields(params: Any) -> set[str]:
    fields = set(typing.get_type_hints(params.CompletionCreateParamsBase, include_extras=True))
    return fields | {"stream"}  # the streaming / non-streaming variants add it


@pytest.mark.parametrize(
    ("params", "body"),
    [(chat_create_params, ChatCompletionRequest), (completion_create_params, CompletionRequest)],
    ids=["chat", "completions"],
)
def test_every_sdk_field_is_served_refused_or_output_neutral(params: Any, body: type) -> None:
    ours = set(body.model_fields)
    unclassified = sorted(_sdk_fields(params) - ours)
    assert not unclassified, (
        f"fields of the openai SDK's {params.__name__} that router/openai_schema.py neither serves, "
        f"refuses by name nor lists as output-neutral: {unclassified}"
    )
    kinds = {
        name: "neutral" if name in OUTPUT_NEUTRAL else "refused" if name in NOT_SERVED else "served"
        for name in _sdk_fields(params)
    }
    assert "served" in kinds.values() and "refused" in kinds.values()
    assert OUTPUT_NEUTRAL.isdisjoint(NOT_SERVED)


@pytest.mark.parametrize("name", sorted(NOT_SERVED))
def test_each_unserved_field_is_refused_naming_it(model: RouterModel, name: str) -> None:
    for schema, base, convert in (
        (ChatCompletionRequest, CHAT, chat_request),
        (CompletionRequest, TEXT, completion_request),
    ):
        if name not in schema.model_fields:
            continue
        body = schema.model_validate({**base, name: ASKING[name]})
        with pytest.raises(ApiError) as info:
            convert(body, model)
        assert info.value.status == 400 and info.value.param == name, info.value.body()
        convert(schema.model_validate({**base, name: NOT_SERVED[name].off[0]}), model)  # off: accepted


@pytest.mark.parametrize("name", sorted(OUTPUT_NEUTRAL))
def test_output_neutral_fields_are_accepted(model: RouterModel, name: str) -> None:
    value: Any = (
        {"a": "b"} if name in ("metadata", "prompt_cache_options") else True if name == "store" else "x"
    )
    chat_request(ChatCompletionRequest.model_validate({**CHAT, name: value}), model)
    if name in CompletionRequest.model_fields:
        completion_request(CompletionRequest.model_validate({**TEXT, name: value}), model)


@pytest.mark.parametrize("name", ["length_penalty", "use_beam_search", "structural_tag", "bad_words"])
def test_an_unknown_field_is_a_400_naming_it(http: TestClient, name: str) -> None:
    with pytest.raises(ValidationError):
        ChatCompletionRequest.model_validate({**CHAT, name: 1})
    for path, base in (("/v1/chat/completions", CHAT), ("/v1/completions", TEXT)):
        response = http.post(path, json={**base, name: 1})
        assert response.status_code == 400, response.text
        error = response.json()["error"]
        assert error["param"] == name and "could change the output" in error["message"]


def test_a_refused_field_over_http_keeps_the_server_serving(http: TestClient) -> None:
    response = http.post("/v1/chat/completions", json={**CHAT, "guided_json": {"type": "object"}})
    error = response.json()["error"]
    assert (
        response.status_code == 400
        and error["param"] == "guided_json"
        and "structured_outputs" in error["message"]
    )
    assert http.post("/tokenize", json={"prompt": "still here"}).status_code == 200


def test_tokenize_detokenize_and_version(http: TestClient, model: RouterModel) -> None:
    tok = http.post(
        "/tokenize", json={"model": "tiny-chat", "prompt": "Hello world", "return_token_strs": True}
    )
    assert tok.status_code == 200, tok.text
    body = tok.json()
    assert body["tokens"] == model.tokenizer.encode("Hello world")
    assert body["count"] == len(body["tokens"]) and body["max_model_len"] == model.context_length
    assert "".join(body["token_strs"]).endswith("world")
    chat = http.post("/tokenize", json={"messages": [{"role": "user", "content": "Hi"}]}).json()
    assert chat["tokens"] == model.tokenizer.apply_chat_template([{"role": "user", "content": "Hi"}])
    back = http.post("/detokenize", json={"tokens": body["tokens"]})
    assert back.status_code == 200 and back.json()["prompt"].endswith("Hello world")
    assert http.get("/version").json()["version"]
    assert http.get("/docs").status_code == 200 and "/v1/chat/completions" in http.get("/openapi.json").text


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/tokenize", {"prompt": "a", "messages": [{"role": "user", "content": "b"}]}, "prompt"),
        ("/tokenize", {}, "prompt"),
        ("/tokenize", {"model": "another", "prompt": "a"}, "model"),
        ("/detokenize", {"tokens": [1, 10**9]}, "tokens.1"),
        ("/detokenize", {"tokens": "abc"}, "tokens"),
    ],
)
def test_bad_tokenize_requests_name_the_field(http: TestClient, path: str, body: dict, param: str) -> None:
    response = http.post(path, json=body)
    assert response.status_code in (400, 404), response.text
    assert response.json()["error"]["param"] == param


def _with_unknown_field(msg: Any, number: int = 1007) -> bytes:
    """``msg`` serialized with one more field: what a client built from a newer .proto sends."""
    tag = (number << 3) | 0  # a varint field
    varint = bytearray()
    while True:
        byte, tag = tag & 0x7F, tag >> 7
        varint.append(byte | (0x80 if tag else 0))
        if not tag:
            break
    return bytes(msg.SerializeToString() + bytes(varint) + b"\x05")


def test_a_cache_salt_past_the_limit_is_refused_on_grpc_as_over_http() -> None:
    """HTTP caps the salt at MAX_CACHE_SALT_LEN; gRPC took a megabyte, which then failed past the prefill
    as a decode-node outage ("retry later") once the node message outgrew gRPC's 4 MB."""
    from pdkv_proto.pdkv.v1 import generation_pb2
    from router.servicer import generation_request
    from serving.errors import ServingError

    ok = generation_request(generation_pb2.GenerateRequest(text="hi", cache_salt="s" * MAX_CACHE_SALT_LEN))
    assert ok.cache_salt == "s" * MAX_CACHE_SALT_LEN
    long = "s" * (MAX_CACHE_SALT_LEN + 1)
    with pytest.raises(ServingError) as info:
        generation_request(generation_pb2.GenerateRequest(text="hi", cache_salt=long))
    assert info.value.code == grpc.StatusCode.INVALID_ARGUMENT
    assert info.value.message.startswith("cache_salt: must be at most")
    # The nodes take what the router forwards: the tenant's tag before a client salt of the full length.
    from pdkv_proto.pdkv.v1 import node_pb2
    from serving import convert

    tagged = Tenant("acme").salt("s" * MAX_CACHE_SALT_LEN, key=b"k" * 32)
    assert len(tagged) > MAX_CACHE_SALT_LEN
    assert convert.cache_salt(node_pb2.PrefillRequest(cache_salt=tagged)) == tagged


def test_grpc_refuses_a_field_it_does_not_know_naming_it() -> None:
    """The same rule on gRPC: protobuf keeps unknown fields aside, so a newer client's field would be
    accepted and dropped; it is refused by number, top level or nested, on the router and the nodes."""
    from pdkv_proto.pdkv.v1 import generation_pb2, node_pb2, types_pb2
    from router.servicer import generation_request
    from serving import convert
    from serving.errors import ServingError

    top = generation_pb2.GenerateRequest.FromString(
        _with_unknown_field(generation_pb2.GenerateRequest(text="hi"))
    )
    nested = generation_pb2.GenerateRequest(
        text="hi",
        sampling=types_pb2.SamplingParams.FromString(_with_unknown_field(types_pb2.SamplingParams())),
    )
    message = generation_pb2.ChatMessage.FromString(
        _with_unknown_field(generation_pb2.ChatMessage(role="user"))
    )
    in_chat = generation_pb2.GenerateRequest(messages=generation_pb2.ChatMessages(messages=[message]))
    # a prompt member under the oneof's name, as the router's own checks name it (an outside probe's find)
    for msg, field in (
        (top, "#1007"),
        (nested, "sampling.#1007"),
        (in_chat, "prompt.messages.messages[0].#1007"),
    ):
        with pytest.raises(ServingError) as info:
            generation_request(msg)
        assert info.value.message.startswith(f"{field}: is not a field of this server's API")
    generation_request(generation_pb2.GenerateRequest(text="hi"))  # a known message passes
    # A logit_bias entry with a newer field: protobuf files the whole entry among the parent's unknown
    # fields under logit_bias's own number, and the refusal named "sampling.#15" -- a known field.
    entry = _with_unknown_field(types_pb2.SamplingParams.LogitBiasEntry(key=5, value=0.5))
    number = types_pb2.SamplingParams.DESCRIPTOR.fields_by_name["logit_bias"].number
    raw = bytes([(number << 3) | 2, len(entry)]) + entry
    biased = generation_pb2.GenerateRequest(text="hi", sampling=types_pb2.SamplingParams.FromString(raw))
    with pytest.raises(ServingError) as info:
        generation_request(biased)
    assert info.value.message.startswith("sampling.logit_bias: holds what this server's API does not have")
    empty = generation_pb2.GenerateRequest(text="hi", sampling={"structured": types_pb2.StructuredOutput()})
    with pytest.raises(ServingError) as info:  # named from the request's top, as every sampling field
        generation_request(empty)
    assert info.value.message.startswith("sampling.structured: names no constraint")
    prefill = node_pb2.PrefillRequest.FromString(_with_unknown_field(node_pb2.PrefillRequest(request_id="r")))
    with pytest.raises(ServingError):
        convert.known_fields_only(prefill)


def test_penalties_bias_and_min_tokens_are_served(model: RouterModel) -> None:
    """Served: they reach SamplingParams by their names (logit_bias keyed by token id), from either front
    end, and bad values are 400s naming them."""
    from router.admission import Admission
    from router.auth import OPEN, Caller

    caller = Caller(OPEN, "peer:test", 8, cache_details=False)
    body = ChatCompletionRequest.model_validate(
        {
            **CHAT,
            "max_tokens": 8,
            "presence_penalty": 0.5,
            "frequency_penalty": -0.25,
            "logit_bias": {"7": -100, "12": 3.5},
            "repetition_penalty": 1.1,
            "min_tokens": 2,
        }
    )
    params = Admission(model).admit(chat_request(body, model), caller).params
    assert (params.presence_penalty, params.frequency_penalty, params.repetition_penalty) == (0.5, -0.25, 1.1)
    assert params.logit_bias == ((7, -100.0), (12, 3.5)) and params.min_tokens == 2
    for bad, param in (
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"frequency_penalty": 3}, "frequency_penalty"),
    ):
        with pytest.raises((ApiError, Exception)) as info:
            Admission(model).admit(
                chat_request(ChatCompletionRequest.model_validate({**CHAT, **bad}), model), caller
            )
        assert param in str(info.value)


def test_grpc_serves_them_and_they_travel_to_the_nodes(model: RouterModel) -> None:
    from pdkv_proto.pdkv.v1 import generation_pb2, types_pb2
    from router.admission import Admission
    from router.auth import OPEN, Caller
    from router.servicer import generation_request
    from serving import convert

    sampling = types_pb2.SamplingParams(
        max_tokens=8, presence_penalty=0.5, repetition_penalty=1.2, logit_bias={7: -100.0}, min_tokens=3
    )
    msg = generation_pb2.GenerateRequest(text="hi", sampling=sampling)
    params = Admission(model).admit(generation_request(msg), Caller(OPEN, "p", 8, cache_details=False)).params
    assert (params.presence_penalty, params.repetition_penalty, params.min_tokens) == (0.5, 1.2, 3)
    assert params.logit_bias == ((7, -100.0),)
    assert convert.sampling_params(convert.sampling_params_proto(params)) == params  # router -> node
    assert convert.sampling_params(types_pb2.SamplingParams()).repetition_penalty == 1.0  # unset: off


def test_top_logprobs_in_openai_shapes(model: RouterModel) -> None:
    """Chat: each content entry carries its top_logprobs; completions: one {token: logprob} map per token."""
    from router.events import Delta, Done, Usage
    from router.openai_responses import ResponseShape

    tok = model.tokenizer
    delta = Delta([5, 6], "xy", [-0.1, -0.2], [((5, -0.1), (9, -2.0)), ((6, -0.2), (5, -3.0))])
    done = Done("length", None, Usage(prompt_tokens=3, completion_tokens=2))
    chat = ResponseShape(model, "id", created=0, chat=True, logprobs=True).whole([([delta], done)])
    content = chat["choices"][0]["logprobs"]["content"]
    assert [e["top_logprobs"][1]["logprob"] for e in content] == [-2.0, -3.0]
    assert content[0]["top_logprobs"][0]["token"] == tok.decode([5], skip_special_tokens=False)
    text = ResponseShape(model, "id", created=0, chat=False, logprobs=True).whole([([delta], done)])
    maps = text["choices"][0]["logprobs"]["top_logprobs"]
    assert maps[1] == {
        tok.decode([6], skip_special_tokens=False): -0.2,
        tok.decode([5], skip_special_tokens=False): -3.0,
    }
    (stream,) = ResponseShape(model, "id", created=0, chat=True, logprobs=True).delta_chunks(delta)
    assert len(stream["choices"][0]["logprobs"]["content"][1]["top_logprobs"]) == 2


def test_top_logprobs_limits_are_400s(model: RouterModel) -> None:
    with pytest.raises(ValidationError) as info:
        ChatCompletionRequest.model_validate({**CHAT, "logprobs": True, "top_logprobs": 21})
    assert info.value.errors()[0]["loc"] == ("top_logprobs",)
    with pytest.raises(ValidationError):
        CompletionRequest.model_validate({**TEXT, "logprobs": 6})
    body = CompletionRequest.model_validate({**TEXT, "logprobs": 3})
    assert completion_request(body, model).sampling["top_logprobs"] == 3


@pytest.mark.parametrize(
    ("extra", "kind"),
    [
        ({"response_format": {"type": "json_object"}}, "json_object"),
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": {"type": "object"}},
                }
            },
            "json_schema",
        ),
        ({"structured_outputs": {"json": {"type": "object"}}}, "json_schema"),
        ({"structured_outputs": {"json": '{"type": "object"}'}}, "json_schema"),
        ({"structured_outputs": {"regex": "[0-9]+"}}, "regex"),
        ({"structured_outputs": {"choice": ["a", "b"]}}, "choice"),
        ({"structured_outputs": {"grammar": 'start: "x"'}}, "grammar"),
    ],
)
def test_structured_outputs_reach_sampling_params(model: RouterModel, extra: dict, kind: str) -> None:
    from router.admission import Admission
    from router.auth import OPEN, Caller

    body = ChatCompletionRequest.model_validate({**CHAT, **extra})
    params = (
        Admission(model).admit(chat_request(body, model), Caller(OPEN, "p", 8, cache_details=False)).params
    )
    assert params.structured is not None and params.structured.kind == kind
    text = {k: v for k, v in extra.items() if k == "structured_outputs"}
    if text:  # completions take structured_outputs too
        assert completion_request(CompletionRequest.model_validate({**TEXT, **text}), model).sampling[
            "structured"
        ]


@pytest.mark.parametrize(
    ("extra", "param"),
    [
        (
            {
                "response_format": {
                    "type": "json_schema",
                    "json_schema": {"name": "p", "schema": {"type": "nope"}},
                }
            },
            "response_format",
        ),
        ({"response_format": {"type": "xml"}}, "response_format.type"),
        (
            {"response_format": {"type": "json_schema", "json_schema": {"name": "p"}}},
            "response_format.json_schema.schema",
        ),
        ({"structured_outputs": {"regex": "(unclosed"}}, "structured_outputs.regex"),
        ({"structured_outputs": {"grammar": "start: nothing_defined"}}, "structured_outputs.grammar"),
        ({"structured_outputs": {"choice": "a"}}, "structured_outputs.choice"),
        ({"structured_outputs": {"regex": "a", "choice": ["a"]}}, "structured_outputs"),
        ({"structured_outputs": {"structural_tag": "x"}}, "structured_outputs.structural_tag"),
        (
            {"structured_outputs": {"json": {}}, "response_format": {"type": "json_object"}},
            "structured_outputs",
        ),
        # min_tokens past a complete constraint could not be kept (it was dropped, silently)
        ({"response_format": {"type": "json_object"}, "min_tokens": 3}, "min_tokens"),
    ],
)
def test_a_bad_constraint_is_a_400_naming_it(http: TestClient, extra: dict, param: str) -> None:
    response = http.post("/v1/chat/completions", json={**CHAT, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param, response.json()


def test_min_tokens_over_max_tokens_and_top_logprobs_without_logprobs_are_400s(model: RouterModel) -> None:
    from router.admission import Admission, InvalidField
    from router.auth import OPEN, Caller

    body = ChatCompletionRequest.model_validate({**CHAT, "max_tokens": 4, "min_tokens": 9})
    with pytest.raises(InvalidField) as info:
        Admission(model).admit(chat_request(body, model), Caller(OPEN, "p", 8, cache_details=False))
    assert info.value.field == "min_tokens"
    with pytest.raises(ApiError) as err:
        chat_request(ChatCompletionRequest.model_validate({**CHAT, "top_logprobs": 3}), model)
    assert err.value.param == "top_logprobs"


# ---- what the SDK may send, as OpenAI reads it (an outside probe found each) --------------------------


def _admitted(model: RouterModel, body: dict[str, Any], chat: bool = True) -> Any:
    from router.admission import Admission
    from router.auth import OPEN, Caller

    caller = Caller(OPEN, "peer:test", 8, cache_details=False)
    request = (
        chat_request(ChatCompletionRequest.model_validate(body), model)
        if chat
        else completion_request(CompletionRequest.model_validate(body), model)
    )
    return Admission(model).admit(request, caller)


@pytest.mark.parametrize("role", ["user", "system", "tool", "developer"])
def test_a_message_without_content_is_refused_unless_an_assistant_s(model: RouterModel, role: str) -> None:
    """OpenAI's rule: only an assistant's content may be null (it called tools); a user message with
    none was taken as an empty turn, silently."""
    body = {
        "model": "tiny-chat",
        "messages": [{"role": role, "content": None}, {"role": "user", "content": "Hi"}],
    }
    with pytest.raises(ApiError) as info:
        chat_request(ChatCompletionRequest.model_validate(body), model)
    assert info.value.param == "messages.0.content" and "is required" in info.value.message
    ok = {
        "model": "tiny-chat",
        "messages": [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": None}],
    }
    chat_request(ChatCompletionRequest.model_validate(ok), model)


def test_null_is_the_field_unset(model: RouterModel) -> None:
    """The SDK's types allow None for n, stream, logprobs, echo ...: null is the default, not a 400."""
    nulls = {"n": None, "stream": None, "logprobs": None, "top_logprobs": None, "temperature": None}
    nulls |= {
        "stream_options": None,
        "top_k": None,
        "min_p": None,
        "ignore_eos": None,
        "stop_token_ids": None,
    }
    admitted = _admitted(model, {**CHAT, **nulls})
    assert admitted.n == 1 and not admitted.params.logprobs and not admitted.params.ignore_eos
    admitted = _admitted(model, {**TEXT, "echo": None, "n": None, "logprobs": None, "best_of": 1}, chat=False)
    assert admitted.n == 1 and not admitted.params.logprobs  # best_of 1 is OpenAI's default: off


@pytest.mark.parametrize(
    ("field", "value"),
    [("max_tokens", "5"), ("max_tokens", True), ("n", 1.5), ("stream", "yes"), ("temperature", "0"),
     ("logprobs", 1), ("stop", 5)],
)  # fmt: skip
def test_types_are_as_strict_as_openai_s(http: TestClient, field: str, value: Any) -> None:
    """ "5" is not a number and true is not 1 (pydantic's lax mode took both): a 400 naming the field --
    the field, not the union branch pydantic tried (``stop.str``)."""
    response = http.post("/v1/chat/completions", json={**CHAT, field: value})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == field
    ChatCompletionRequest.model_validate({**CHAT, "temperature": 1, "top_p": 1})  # an integer is a float


def test_stream_options_without_a_stream_is_refused(model: RouterModel) -> None:
    body = ChatCompletionRequest.model_validate({**CHAT, "stream_options": {"include_usage": True}})
    with pytest.raises(ApiError) as info:
        chat_request(body, model)
    assert info.value.param == "stream_options" and "stream: true" in info.value.message
    chat_request(ChatCompletionRequest.model_validate({**CHAT, "stream": True, "stream_options": {}}), model)


def test_stream_obfuscation_is_refused_when_asked_for_and_off_is_accepted(model: RouterModel) -> None:
    """The SDK's ``stream_options.include_obfuscation`` was refused as a field that "could change the
    output", whatever its value: false asks for what pdkv does, true for padding it does not send."""
    stream = {**CHAT, "stream": True}
    off = {"include_usage": True, "include_obfuscation": False}
    chat_request(ChatCompletionRequest.model_validate({**stream, "stream_options": off}), model)
    body = ChatCompletionRequest.model_validate({**stream, "stream_options": {"include_obfuscation": True}})
    with pytest.raises(ApiError) as info:
        chat_request(body, model)
    assert info.value.param == "stream_options.include_obfuscation" and "not served" in info.value.message


def test_response_format_on_completions_points_to_structured_outputs(http: TestClient) -> None:
    response = http.post("/v1/completions", json={**TEXT, "response_format": {"type": "json_object"}})
    error = response.json()["error"]
    assert response.status_code == 400 and error["param"] == "response_format"
    assert "structured_outputs" in error["message"] and "/v1/chat/completions" in error["message"]


@pytest.mark.parametrize(
    ("response_format", "param"),
    [
        ({"type": "text", "json_schema": {"schema": {}}}, "response_format.json_schema"),
        ({"type": "json_object", "schema": {}}, "response_format.schema"),
        (
            {"type": "json_schema", "json_schema": {"schema": {}, "stict": True}},
            "response_format.json_schema.stict",
        ),
    ],
)
def test_a_response_format_key_its_type_does_not_take_is_refused(
    model: RouterModel, response_format: dict[str, Any], param: str
) -> None:
    """Never dropped: a schema sent with type text would have been ignored."""
    body = ChatCompletionRequest.model_validate({**CHAT, "response_format": response_format})
    with pytest.raises(ApiError) as info:
        chat_request(body, model)
    assert info.value.param == param and "is not a key of" in info.value.message
    ok = {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}, "strict": True}}
    chat_request(ChatCompletionRequest.model_validate({**CHAT, "response_format": ok}), model)


def test_a_body_that_is_not_json_or_not_utf8_gets_openai_s_error_shape(http: TestClient) -> None:
    cut = http.post("/v1/chat/completions", content=b'{"model": "x", "messages": [', headers=JSON_HEADERS)
    error = cut.json()["error"]
    assert (
        cut.status_code == 400
        and error["param"] == "body"
        and "not valid JSON at byte 28" in error["message"]
    )
    raw = http.post("/v1/chat/completions", content=b'{"model": "\xff"}', headers=JSON_HEADERS)
    error = raw.json()["error"]
    assert raw.status_code == 400 and error["type"] == "invalid_request_error", raw.text
    assert error["param"] == "body" and "not valid JSON at byte 11" in error["message"], raw.text
    missing = http.get("/v1/no-such-path")
    assert missing.status_code == 404 and missing.json()["error"]["message"], missing.text


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/completions", '{"model": "tiny-chat", "prompt": "a \\ud800 b"}', "prompt"),
        (
            "/v1/chat/completions",
            '{"model": "tiny-chat", "messages": [{"role": "user", "content": "hi \\ud83d"}]}',
            "messages.0.content",
        ),
        ("/v1/completions", '{"model": "tiny-chat", "prompt": "hi", "stop": ["ok", "\\udc00"]}', "stop.1"),
        (
            "/v1/completions",
            '{"model": "tiny-chat", "prompt": "hi", "structured_outputs": {"regex": "\\ud800"}}',
            "structured_outputs.regex",
        ),
        (
            "/v1/completions",
            '{"model": "tiny-chat", "prompt": "hi", "metadata": {"\\ud800": "x"}}',
            "metadata.\\ud800",
        ),
        ("/tokenize", '{"model": "tiny-chat", "prompt": "\\ud800"}', "prompt"),
        ("/v1/load_lora_adapter", '{"lora_name": "a", "lora_path": "/tmp/\\udc80"}', "lora_path"),
    ],
)
def test_text_with_a_lone_surrogate_is_a_400_naming_it(
    http: TestClient, path: str, body: str, param: str
) -> None:
    """JSON may escape half a surrogate pair ("\\ud800"): Python decodes it to a str with no UTF-8 form,
    which the tokenizer, the node messages and the logs refuse -- a 500 and a traceback, before. Now the
    field is named; a paired escape (an emoji) is text like any other."""
    answer = http.post(path, content=body.encode(), headers=JSON_HEADERS)
    error = answer.json()["error"]
    assert answer.status_code == 400 and error["param"] == param, answer.text
    assert "lone UTF-16 surrogate" in error["message"]
    emoji = '{"model": "tiny-chat", "prompt": "\\ud83d\\ude00"}'
    assert http.post("/tokenize", content=emoji.encode(), headers=JSON_HEADERS).status_code == 200


def test_a_fault_of_the_server_s_own_is_a_500_in_openai_s_shape(
    model: RouterModel, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Never a plain-text "Internal Server Error": the SDK parses the shape (and no traceback is sent)."""
    http = TestClient(
        create_app(SimpleNamespace(max_inflight=1), model, healthy=lambda: True),
        raise_server_exceptions=False,
    )

    def broken(*_: Any, **__: Any) -> Any:
        raise RuntimeError("a bug's secret detail")

    monkeypatch.setattr(model.tokenizer, "encode", broken)
    answer = http.post("/tokenize", json={"model": "tiny-chat", "prompt": "hi"})
    error = answer.json()["error"]
    assert answer.status_code == 500 and error["type"] == "internal_error", answer.text
    assert "RuntimeError" in error["message"] and "secret" not in answer.text


def test_http_calls_are_counted_by_route_and_status_beside_the_grpc_ones(model: RouterModel) -> None:
    """The dashboard's "failed calls by code" reads rpcs_total: HTTP calls were counted nowhere, so every
    refusal over the OpenAI API was invisible.  The route's template is the label, never the client's
    path (unbounded), and the status goes by gRPC's name."""
    calls = RpcCounters()
    http = TestClient(create_app(SimpleNamespace(max_inflight=1), model, healthy=lambda: True, calls=calls))
    assert http.get("/version").status_code == 200
    assert http.post("/tokenize", json={"model": "tiny-chat", "prompt": "hi"}).status_code == 200
    assert http.post("/v1/chat/completions", json={**CHAT, "best_of": 2}).status_code == 400
    assert http.post("/tokenize", json={"model": "nope", "prompt": "hi"}).status_code == 404
    assert http.get("/no/such/path/123").status_code == 404
    assert http.request("X0", "/tokenize").status_code == 405  # h11 takes any token: no label of its own
    [rpcs, errors] = calls.families("pdkv_router")
    counted = {tuple(s.labels.values()): s.value for s in rpcs.samples}
    assert counted == {
        ("GET /version", "OK"): 1.0,
        ("POST /tokenize", "OK"): 1.0,
        ("POST /v1/chat/completions", "INVALID_ARGUMENT"): 1.0,
        ("POST /tokenize", "NOT_FOUND"): 1.0,
        ("unrouted", "NOT_FOUND"): 1.0,
        ("unrouted", "UNIMPLEMENTED"): 1.0,
    }
    assert {tuple(s.labels.values()) for s in errors.samples} == {k for k in counted if k[1] != "OK"}


def test_the_key_and_the_body_s_size_are_checked_before_the_body_is_read(model: RouterModel) -> None:
    """A caller without a key gets its 401 before the router reads (buffers) the body, whatever the body
    holds (a security probe sent 400 MB and got a detailed 400); a body past the limit is a 413 naming it."""
    key = "sk-test-gate"
    access = Access({key_digest(key): Tenant("acme")})
    served = create_app(SimpleNamespace(max_inflight=1), model, healthy=lambda: True, access=access)
    assert isinstance(served, HttpGate)  # the app as the router serves it: gated
    gated = HttpGate(served.app, access, max_body_bytes=1000)  # a small limit for the test
    read: list[int] = []

    async def reading(scope: Any, receive: Any, send: Any) -> None:
        async def counted() -> Any:
            message = await receive()
            read.append(len(message.get("body", b"")))
            return message

        await gated(scope, counted, send)

    http = TestClient(reading)
    bad = http.post("/v1/completions", content=b"{not json", headers=JSON_HEADERS)
    assert bad.status_code == 401 and bad.json()["error"]["type"] == "authentication_error", bad.text
    assert "JSON" not in bad.text
    body = {"model": "tiny-chat", "prompt": "hi"}
    wrong = http.post("/tokenize", json=body, headers={"authorization": "Bearer no"})
    assert wrong.status_code == 401 and read == [], "nothing of a refused call's body is read"
    twice = [("authorization", "Bearer no"), ("authorization", f"Bearer {key}")]  # the routes read the first
    assert http.post("/tokenize", content=b"{not json", headers=twice).status_code == 401 and read == []
    assert http.get("/version").status_code == 200  # open, as vLLM's
    auth = {"authorization": f"Bearer {key}"}
    ok = http.post("/tokenize", json={"model": "tiny-chat", "prompt": "hi"}, headers=auth)
    assert ok.status_code == 200, ok.text
    big = http.post("/tokenize", content=b"x" * 1001, headers={**auth, **JSON_HEADERS})
    assert big.status_code == 413 and big.json()["error"]["param"] == "body", big.text

    def chunks() -> Iterator[bytes]:  # no Content-Length: counted as it arrives
        for _ in range(5):
            yield b"y" * 300

    streamed = http.post("/tokenize", content=chunks(), headers={**auth, **JSON_HEADERS})
    assert streamed.status_code == 413, streamed.text
    assert http.get("/health").status_code == 200  # probes need no key


JSON_HEADERS = {"content-type": "application/json"}


def test_ignore_eos_in_a_chat_ignores_the_end_of_turn_tokens_too(model: RouterModel) -> None:
    """The template's end-of-turn tokens are the chat's end of sequence: with ignore_eos they do not stop
    the reply (it had stopped at <|im_end|> all the same); the request's own stop_token_ids still do."""
    eot = set(model.tokenizer.end_of_turn_token_ids)
    assert eot <= set(_admitted(model, CHAT).params.stop_token_ids)
    params = _admitted(model, {**CHAT, "ignore_eos": True, "stop_token_ids": [5]}).params
    assert params.ignore_eos and params.stop_token_ids == (5,)


def test_the_router_admits_and_advertises_the_context_its_nodes_serve(model: RouterModel) -> None:
    """An outside probe: nodes whose KV cache held less than the model's context admitted requests that
    could never finish.  The nodes now serve at most what their cache holds and say so in Stats; the
    router admits by the smallest (a longer prompt: a 400 from the router, not a node's error) and lists
    it in /v1/models, /tokenize and GetModelInfo."""
    from router.admission import Admission
    from router.auth import OPEN, Caller
    from router.nodes import NodeHandle, NodePool, served_context

    nodes = [NodeHandle(f"127.0.0.1:{i}", "pdkv.v1.DecodeNode") for i in (1, 2)]
    for node, length in zip(nodes, (100, 64), strict=True):
        node.max_model_len = length
        node.mark_up()
    pool = NodePool("decode", [], "pdkv.v1.DecodeNode")
    pool._nodes = {n.address: n for n in nodes}
    try:
        assert served_context([pool]) == 64
        nodes[1].mark_down("gone")  # only what healthy nodes serve counts
        assert served_context([pool]) == 100
        nodes[1].mark_up()
        admission = Admission(model, node_context=lambda: served_context([pool]))
        assert model.context_length > 64 and admission.context_length == 64
        assert Admission(model, node_context=lambda: 0).context_length == model.context_length  # none said
        caller = Caller(OPEN, "peer:test", 8, cache_details=False)
        text = {**TEXT, "prompt": list(range(5, 69))}  # 64 tokens: no room for one more
        with pytest.raises(Exception, match="as many as max_model_len 64 holds: no room for an output token"):
            admission.admit(completion_request(CompletionRequest.model_validate(text), model), caller)
        # ... but it may be scored alone (echo, max_tokens 0: a full window, as eval harnesses score them)
        scored = {**text, "echo": True, "max_tokens": 0, "logprobs": 0}
        admitted = admission.admit(
            completion_request(CompletionRequest.model_validate(scored), model), caller
        )
        assert len(admitted.prompt_token_ids) == 64 and admitted.params.max_tokens == 0
        with pytest.raises(Exception, match="65 tokens, more than max_model_len 64 holds"):
            longer = {**scored, "prompt": list(range(5, 70))}
            admission.admit(completion_request(CompletionRequest.model_validate(longer), model), caller)
        asked = {**TEXT, "prompt": list(range(5, 15)), "max_tokens": 60}
        with pytest.raises(Exception, match="ask for at most 54"):
            admission.admit(completion_request(CompletionRequest.model_validate(asked), model), caller)
        pipeline: Any = SimpleNamespace(max_inflight=1, prefill_pool=None, decode_pool=pool)
        with TestClient(create_app(pipeline, model, healthy=lambda: True, admission=admission)) as http:
            [card] = http.get("/v1/models").json()["data"]
            assert card["max_model_len"] == card["context_length"] == 64
            assert http.post("/tokenize", json={"prompt": "hi"}).json()["max_model_len"] == 64
    finally:
        for n in nodes:
            n.close()


def test_only_a_tenant_allowed_to_manage_adapters_loads_or_unloads_them(model: RouterModel) -> None:
    """An outside probe's find: with API keys, any tenant could replace (load_inplace) or unload the
    adapters every other tenant runs -- one tenant's reload of A gave another B's weights.  Loads and
    unloads now need the keys file's ``manage_adapters = true`` (403 otherwise); the open router's one
    tenant may, as before."""
    from unittest import mock

    from pdkv_proto.pdkv.v1 import types_pb2
    from router.adapters import RouterAdapters
    from router.admission import Admission
    from router.nodes import NodeHandle, NodePool

    user, ops = "sk-test-tenant-user", "sk-test-tenant-ops"
    access = Access({key_digest(user): Tenant("acme"), key_digest(ops): Tenant("ops", manage_adapters=True)})
    node = NodeHandle("127.0.0.1:1", "pdkv.v1.DecodeNode")
    node.mark_up()
    pool = NodePool("decode", [], "pdkv.v1.DecodeNode")
    pool._nodes = {node.address: node}
    admission = Admission(model, adapters=RouterAdapters([pool], allow_runtime=True, base_name=model.name))
    pipeline: Any = SimpleNamespace(max_inflight=4, prefill_pool=None, decode_pool=pool)
    app = create_app(pipeline, model, healthy=lambda: True, access=access, admission=admission)
    load = {"lora_name": "A", "lora_path": "/adapters/a"}
    try:
        with mock.patch.object(node, "control") as control, TestClient(app) as http:
            control.LoadAdapter.return_value = types_pb2.AdapterInfo(name="A", digest=bytes(32))
            control.UnloadAdapter.return_value = types_pb2.UnloadAdapterResponse()
            for path, body in (
                ("/v1/load_lora_adapter", load),
                ("/v1/unload_lora_adapter", {"lora_name": "A"}),
            ):
                denied = http.post(path, json=body, headers={"authorization": f"Bearer {user}"})
                assert denied.status_code == 403, denied.text
                assert denied.json()["error"]["type"] == "permission_error"
                assert "manage_adapters" in denied.json()["error"]["message"]
            assert control.LoadAdapter.call_count == control.UnloadAdapter.call_count == 0
            allowed = http.post(
                "/v1/load_lora_adapter", json=load, headers={"authorization": f"Bearer {ops}"}
            )
            assert allowed.status_code == 200, allowed.text
            gone = http.post(
                "/v1/unload_lora_adapter", json={"lora_name": "A"}, headers={"authorization": f"Bearer {ops}"}
            )
            assert gone.status_code == 200, gone.text
            assert control.LoadAdapter.call_count == control.UnloadAdapter.call_count == 1
    finally:
        node.close()


def test_a_text_too_long_for_any_tokenization_is_refused_before_it_is_tokenized(
    model: RouterModel, http: TestClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    """An outside probe's find: a 4 MB prompt was tokenized (1.9 s, the GIL held: every other call
    waited) before its refusal.  Text longer than the context could hold at the vocabulary's longest
    token (twice over) is refused at once, naming the field; text that might fit is tokenized."""
    from router.admission import Admission, InvalidField

    admission = Admission(model)
    caller = Caller(OPEN, "peer:test", 8, cache_details=False)
    limit = 2 * admission.context_length * model.tokenizer.max_token_chars
    encoded: list[int] = []
    real_encode = model.tokenizer.encode
    monkeypatch.setattr(
        model.tokenizer, "encode", lambda text, **kw: encoded.append(len(text)) or real_encode(text, **kw)
    )
    user = {"role": "user", "content": "hi"}
    huge_call = {
        "id": "c1",
        "type": "function",
        "function": {"name": "f", "arguments": json.dumps({"a": "z" * limit})},
    }
    for body, param in (
        ({**TEXT, "prompt": "x" * (limit + 1)}, "prompt"),
        ({**CHAT, "messages": [{"role": "user", "content": "y" * (limit + 1)}]}, "messages"),
        # everything the template or the tool format renders counts (an outside probe's 3 MB tool
        # description was tokenized whole, 3.7 s with the GIL held, before its refusal)
        (
            {
                **CHAT,
                "messages": [user],
                "tools": [{"type": "function", "function": {"name": "t", "description": "d" * limit}}],
            },
            "tools",
        ),
        ({**CHAT, "messages": [user, {"role": "assistant", "tool_calls": [huge_call]}]}, "messages"),
        ({**CHAT, "messages": [{**user, "name": "n" * (limit + 1)}]}, "messages"),
    ):
        parse = completion_request if param == "prompt" else chat_request
        schema = CompletionRequest if param == "prompt" else ChatCompletionRequest
        with pytest.raises(InvalidField, match="characters: more than max_model_len") as refused:
            admission.admit(parse(schema.model_validate(body), model), caller)
        assert refused.value.field == param
    # /tokenize too (a review's find: it went round the check)
    for body, param in (
        ({"prompt": "x" * (limit + 1)}, "prompt"),
        ({"messages": [{"role": "user", "content": "y" * (limit + 1)}]}, "messages"),
    ):
        answer = http.post("/tokenize", json=body)
        assert answer.status_code == 400 and answer.json()["error"]["param"] == param, answer.text
    assert encoded == []
    admission.admit(
        completion_request(CompletionRequest.model_validate({**TEXT, "prompt": "hi"}), model), caller
    )
    assert encoded == [2]


def test_text_offsets_point_at_each_token_s_text_when_tokens_split_a_character(model: RouterModel) -> None:
    """An outside probe's find: a character split over tokens (an emoji's UTF-8 bytes) moved every later
    text_offset by one per piece -- each piece, decoded alone, is U+FFFD -- so offsets pointed past the
    text.  They come from decoding the tokens in order now."""
    from router.openai_responses import _Offsets

    text = "I like \U0001f31f stars and \u65e5\u672c\u8a9e text"
    ids = model.tokenizer.encode(text, add_special_tokens=False)
    assert model.tokenizer.decode(ids) == text
    pieces = [model.tokenizer.decode([t]) for t in ids]
    assert any("\ufffd" in p for p in pieces), "the test needs a character split over tokens"
    offsets = _Offsets(model).of(ids)
    assert offsets == sorted(offsets) and offsets[-1] < len(text)
    for at, piece in zip(offsets, pieces, strict=True):
        if "\ufffd" not in piece:
            assert text[at : at + len(piece)] == piece, (at, piece)
    assert offsets[-1] + len(pieces[-1]) == len(text)
    streamed = _Offsets(model)  # a stream's chunks: the offsets run on
    assert streamed.of(ids[:5]) + streamed.of(ids[5:]) == offsets


def test_an_echoed_prompt_s_offsets_count_its_special_tokens_as_its_text_shows_them(
    model: RouterModel,
) -> None:
    """A review's find: the offsets decoded without special tokens, while a token-id prompt's echo shows
    them -- the completion's offsets then started inside the echoed text."""
    from router.openai_responses import _Offsets

    special = model.eos_token_ids[0]
    ids = [special, *model.tokenizer.encode("Hello world, caf\u00e9", add_special_tokens=False)]
    text = model.tokenizer.decode(ids, skip_special_tokens=False)  # as echo_of shows a token-id prompt
    assert len(text) > len(model.tokenizer.decode(ids))
    generated = model.tokenizer.encode(" and more", add_special_tokens=False)
    offsets = _Offsets(model)
    prompt_offsets = offsets.echo(ids, text)
    assert prompt_offsets[0] == 0 and prompt_offsets == sorted(prompt_offsets)
    for at, t in zip(prompt_offsets, ids, strict=True):
        piece = model.tokenizer.decode([t], skip_special_tokens=False)
        if "\ufffd" not in piece:
            assert text[at : at + len(piece)] == piece
    assert offsets.of(generated)[0] == len(text)  # the completion starts where the echo ends


def test_a_completion_stream_s_text_offsets_run_on_across_its_chunks(model: RouterModel) -> None:
    """The stream's offsets equal the whole answer's: a chunk's clock must not restart (a regression the
    cluster test caught: every chunk's offsets began at 0 again)."""
    from router.events import Delta
    from router.openai_responses import ResponseShape

    ids = model.tokenizer.encode("one two three four five six", add_special_tokens=False)
    pieces = [model.tokenizer.decode([t]) for t in ids]
    deltas = [Delta([t], p, [-0.5]) for t, p in zip(ids, pieces, strict=True)]
    stream = ResponseShape(model, "cmpl-1", created=0, chat=False, logprobs=True)
    streamed = [
        o for d in deltas for c in stream.delta_chunks(d) for o in c["choices"][0]["logprobs"]["text_offset"]
    ]
    whole = ResponseShape(model, "cmpl-2", created=0, chat=False, logprobs=True)
    assert streamed == whole._logprobs(ids, [-0.5] * len(ids), [], _fresh_offsets(model))["text_offset"]
    assert streamed == sorted(streamed) and streamed[-1] == len("".join(pieces[:-1]))


def _fresh_offsets(model: RouterModel) -> Any:
    from router.openai_responses import _Offsets

    return _Offsets(model)


@pytest.mark.parametrize("echo", [False, True])
def test_completions_logprobs_0_maps_each_token_to_its_own_logprob(model: RouterModel, echo: bool) -> None:
    """An eval harness reads top_logprobs[i][tokens[i]]: with logprobs 0 (no alternatives) each map holds
    the token alone -- a probe found top_logprobs null, plain and echoed; an echoed prompt's first token,
    which has no logprob, keeps None."""
    from router.events import Delta, Done, Usage
    from router.openai_responses import ResponseShape

    delta = Delta([5, 6], "xy", [-0.1, -0.2])  # logprobs 0: no alternatives come with the tokens
    done = Done("length", None, Usage(prompt_tokens=3, completion_tokens=2))
    shape = ResponseShape(model, "id", created=0, chat=False, logprobs=True)
    offsets = _fresh_offsets(model)
    ids, lps, tops = [5, 6], [-0.1, -0.2], []
    if echo:  # an echoed prompt [7, 8] before them: its first token has no logprob
        ids, lps, tops = [7, 8, *ids], [None, -1.5, *lps], [None, ()]
    got = shape._logprobs(ids, lps, tops, offsets, echoed=2 if echo else 0)
    maps = zip(got["top_logprobs"], got["tokens"], strict=True)
    assert [None if m is None else m[t] for m, t in maps] == lps
    whole = shape.whole([([delta], done)])["choices"][0]["logprobs"]
    assert [m[t] for m, t in zip(whole["top_logprobs"], whole["tokens"], strict=True)] == [-0.1, -0.2]


@pytest.mark.parametrize("field", ["max_tokens", "max_completion_tokens"])
def test_a_max_tokens_that_cannot_be_served_is_refused_under_the_name_the_client_used(
    model: RouterModel, field: str
) -> None:
    """A probe sent max_completion_tokens 100000 and was refused naming max_tokens, a field it never sent."""
    from router.admission import Admission, InvalidField
    from router.auth import OPEN, Caller

    caller = Caller(OPEN, "p", 8, cache_details=False)
    for extra in ({field: 10**6}, {field: 4, "min_tokens": 9}):
        body = ChatCompletionRequest.model_validate({**CHAT, **extra})
        with pytest.raises(InvalidField) as info:
            Admission(model).admit(chat_request(body, model), caller)
        assert info.value.field == (field if "min_tokens" not in extra else "min_tokens")
        message = info.value.message
        assert field in message and (field == "max_tokens" or "max_tokens " not in message)
    limited = Admission(model, max_tokens_limit=8)
    with pytest.raises(InvalidField) as info:
        limited.admit(chat_request(ChatCompletionRequest.model_validate({**CHAT, field: 9}), model), caller)
    assert info.value.field == field


TOOL = {"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}


@pytest.mark.parametrize(
    "constraint",
    [
        {"structured_outputs": {"choice": ["yes", "no"]}},
        {"response_format": {"type": "json_object"}},
        {"tools": [TOOL], "tool_choice": "required"},
    ],
)
def test_a_constrained_output_refuses_min_tokens_by_name_and_serves_ignore_eos(
    model: RouterModel, constraint: dict[str, Any]
) -> None:
    """A completed constraint ends the output: min_tokens could not be kept (refused); ignore_eos is
    served until the constraint completes (load generators send it with every request)."""
    from router.admission import InvalidField

    with pytest.raises(InvalidField) as info:
        _admitted(model, {**CHAT, "max_tokens": 5, **constraint, "min_tokens": 3})
    assert info.value.field == "min_tokens" and "structured output" in info.value.message
    assert _admitted(model, {**CHAT, "max_tokens": 5, **constraint, "ignore_eos": True}).params.ignore_eos


@pytest.mark.parametrize("name", [None, "", "a b!", "x" * 65, 7])
def test_a_json_schema_without_a_valid_name_is_refused_naming_it(model: RouterModel, name: Any) -> None:
    """OpenAI requires json_schema.name (1-64 of [A-Za-z0-9_-]); a probe's request without one, or with
    "a b!", was served -- one OpenAI refuses."""
    spec: dict[str, Any] = {"schema": {"type": "object"}}
    if name is not None:
        spec["name"] = name
    body = ChatCompletionRequest.model_validate(
        {**CHAT, "response_format": {"type": "json_schema", "json_schema": spec}}
    )
    with pytest.raises(ApiError) as info:
        chat_request(body, model)
    assert info.value.param == "response_format.json_schema.name", info.value.body()
    spec["name"] = "a-B_9" * 12 + "abcd"  # 64 characters
    chat_request(
        ChatCompletionRequest.model_validate(
            {**CHAT, "response_format": {"type": "json_schema", "json_schema": spec}}
        ),
        model,
    )
