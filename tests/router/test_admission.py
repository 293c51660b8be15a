"""One admission path (router/admission.py) for both front ends, one node-message builder, usage once.

Both front ends only convert: a gRPC ``GenerateRequest`` and an OpenAI body asking the same thing admit
to the same ``AdmittedRequest``, and both are refused for the same reasons, each naming the field as its
client spells it.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from engine.outputs import RequestOutput
from engine.sampling_params import SamplingParams
from pdkv_proto.pdkv.v1 import generation_pb2, node_pb2, types_pb2
from router.admission import (
    DEFAULT_MAX_TOKENS,
    MAX_DEFAULT_CHAT_TOKENS,
    Admission,
    AdmittedRequest,
    GenerationRequest,
    InvalidField,
)
from router.auth import OPEN, Caller
from router.node_messages import carried_tokens, decode_message, prefill_message
from router.openai_requests import chat_request, completion_request
from router.openai_schema import ChatCompletionRequest, CompletionRequest
from router.servicer import generation_request
from router.tokenizer import RouterModel, load_model
from serving import convert
from tests.gguf_models import write_gguf
from tests.tiny_models import pdkv_tiny_model_dir

CALLER = Caller(OPEN, "peer:test", 8, cache_details=False)


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> RouterModel:
    path: Path = tmp_path_factory.mktemp("admission") / "tiny-chat.gguf"
    return load_model(write_gguf(pdkv_tiny_model_dir(), path, qtype="F32"))


def grpc_text(text: str, **sampling: object) -> GenerationRequest:
    msg = generation_pb2.GenerateRequest(text=text, sampling=types_pb2.SamplingParams(**sampling))  # type: ignore[arg-type]
    return generation_request(msg)


def grpc_chat(content: str, **sampling: object) -> GenerationRequest:
    messages = generation_pb2.ChatMessages(
        messages=[generation_pb2.ChatMessage(role="user", content=content)]
    )
    msg = generation_pb2.GenerateRequest(messages=messages, sampling=types_pb2.SamplingParams(**sampling))  # type: ignore[arg-type]
    return generation_request(msg)


def grpc_token_ids(ids: list[int]) -> GenerationRequest:
    return generation_request(generation_pb2.GenerateRequest(token_ids=generation_pb2.TokenIds(ids=ids)))


def http_completion(model: RouterModel, **body: object) -> GenerationRequest:
    return completion_request(CompletionRequest(model=model.name, **body), model)  # type: ignore[arg-type]


def http_chat(model: RouterModel, content: str, **body: object) -> GenerationRequest:
    messages = [{"role": "user", "content": content}]
    return chat_request(ChatCompletionRequest(model=model.name, messages=messages, **body), model)  # type: ignore[arg-type]


def same(a: AdmittedRequest, b: AdmittedRequest) -> bool:
    return dataclasses.replace(a, request_id="x") == dataclasses.replace(b, request_id="x")


def test_both_front_ends_admit_the_same_request(model: RouterModel) -> None:
    admission = Admission(model)
    sampling = {"max_tokens": 7, "temperature": 0.5, "top_k": 3, "seed": 11, "stop": ["."]}
    g = admission.admit(grpc_text("Hello there", **sampling), CALLER)
    h = admission.admit(http_completion(model, prompt="Hello there", **sampling), CALLER)
    assert same(g, h) and g.params.max_tokens == 7 and g.params.stop == (".",)
    ids = model.tokenizer.encode("Hello there")
    assert g.prompt_token_ids == ids
    tokens = admission.admit(http_completion(model, prompt=ids, **sampling), CALLER)
    assert same(tokens, h)
    gc = admission.admit(grpc_chat("hi", max_tokens=5, temperature=0.0), CALLER)
    hc = admission.admit(http_chat(model, "hi", max_tokens=5, temperature=0.0), CALLER)
    assert same(gc, hc)
    assert set(model.tokenizer.end_of_turn_token_ids) <= set(gc.params.stop_token_ids)


def test_one_max_tokens_default_for_both_front_ends(model: RouterModel) -> None:
    """Unset: 16 for text or token ids, up to 4096 (the room the context leaves) for a conversation --
    on gRPC too, where a conversation used to stop after 16 tokens."""
    admission = Admission(model)
    assert admission.admit(grpc_text("Hello"), CALLER).params.max_tokens == DEFAULT_MAX_TOKENS
    assert (
        admission.admit(http_completion(model, prompt="Hello"), CALLER).params.max_tokens
        == DEFAULT_MAX_TOKENS
    )
    chat = [admission.admit(r, CALLER) for r in (grpc_chat("hi"), http_chat(model, "hi"))]
    room = model.context_length - len(chat[0].prompt_token_ids)
    assert [c.params.max_tokens for c in chat] == [min(room, MAX_DEFAULT_CHAT_TOKENS)] * 2
    limited = Admission(model, max_tokens_limit=8)  # a default is cut to the router's limit, never refused
    assert limited.admit(grpc_text("Hello"), CALLER).params.max_tokens == 8
    assert limited.admit(http_chat(model, "hi"), CALLER).params.max_tokens == 8


@pytest.mark.parametrize(
    ("sampling", "grpc_field", "http_field", "says"),
    [
        ({"max_tokens": 5000}, "sampling.max_tokens", "max_tokens", "does not fit"),  # prompt + it > context
        ({"max_tokens": 9}, "sampling.max_tokens", "max_tokens", "max_tokens_limit 8"),
        ({"stop_token_ids": [5, 10**6]}, "sampling.stop_token_ids[1]", "stop_token_ids[1]", "vocabulary"),
        ({"top_k": 2, "min_p": 1.5}, "sampling.min_p", "min_p", "[0, 1]"),
    ],
)
def test_both_front_ends_refuse_alike_naming_the_field(
    model: RouterModel, sampling: dict, grpc_field: str, http_field: str, says: str
) -> None:
    admission = Admission(model, max_tokens_limit=8 if sampling.get("max_tokens") == 9 else 0)
    http_body = {k: v for k, v in sampling.items()}
    for request, field in (
        (grpc_text("Hello", **sampling), grpc_field),
        (_http(model, http_body), http_field),
    ):
        with pytest.raises(InvalidField) as info:
            admission.admit(request, CALLER)
        assert (
            info.value.field == field
            and info.value.message.startswith(f"{field}: ")
            and says in info.value.message
        )


def _http(model: RouterModel, body: dict) -> GenerationRequest:
    if "min_p" in body:  # the schema refuses it first (400 naming it): build past it to reach admission
        request = http_completion(model, prompt="Hello")
        return dataclasses.replace(request, sampling={**request.sampling, **body})
    return http_completion(model, prompt="Hello", **body)


def test_prompts_are_refused_naming_their_own_field(model: RouterModel) -> None:
    admission = Admission(model)
    cases = [
        (grpc_text(""), "prompt.text", "is empty"),
        (grpc_token_ids([1, 999]), "prompt.token_ids.ids[1]", "vocabulary"),
        (http_completion(model, prompt=[1, -2]), "prompt.1", "vocabulary"),
        (grpc_text("many words " * 3000), "prompt.text", "max_model_len"),
        (http_chat(model, "many words " * 3000), "messages", "max_model_len"),
    ]  # fmt: skip
    for request, field, says in cases:
        with pytest.raises(InvalidField) as info:
            admission.admit(request, CALLER)
        assert info.value.field == field and says in info.value.message


def test_the_nodes_max_model_len_is_the_router_s_context(model: RouterModel, tmp_path: Path) -> None:
    """--max-model-len: a request that would not fit the nodes' context is refused at the router."""
    path = write_gguf(pdkv_tiny_model_dir(), tmp_path / "short.gguf", qtype="F32")
    short = load_model(path, max_model_len=64)
    assert short.context_length == 64 and model.context_length > 64
    request = grpc_token_ids([5] * 60)
    Admission(model).admit(request, CALLER)
    with pytest.raises(InvalidField, match=r"\(max_model_len\) holds 64; ask for at most 4"):
        Admission(short).admit(dataclasses.replace(request, sampling={"max_tokens": 10}), CALLER)
    with pytest.raises(ValueError, match="exceeds the model's max_position_embeddings"):
        load_model(path, max_model_len=model.context_length + 1)


def test_the_tenant_sets_the_salt_at_admission(model: RouterModel) -> None:
    from router.auth import Tenant

    acme = Caller(Tenant("acme"), "tenant:acme", 8, cache_details=False)
    request = dataclasses.replace(grpc_text("Hello"), cache_salt="mine")
    assert Admission(model).admit(request, acme).cache_salt == "acme/mine"
    assert Admission(model).admit(request, CALLER).cache_salt == "mine"


def test_proto_and_engine_sampling_fields_are_the_same() -> None:
    """The conversion is by name: a sampling field is the proto's field and SamplingParams's, nothing in
    between."""
    proto = set(types_pb2.SamplingParams.DESCRIPTOR.fields_by_name)
    assert proto == {f.name for f in dataclasses.fields(SamplingParams)}
    params = SamplingParams(
        max_tokens=9, temperature=0.7, top_p=0.5, seed=3, stop=("x",), stop_token_ids=(4,)
    )
    assert convert.sampling_params(convert.sampling_params_proto(params)) == params
    assert convert.sampling_params(types_pb2.SamplingParams()) == SamplingParams()


def test_every_node_message_is_built_alike() -> None:
    request = AdmittedRequest("pdkv-1", [1, 2, 3], SamplingParams(max_tokens=5, seed=2), "salt")
    prefill = prefill_message(request)
    first = node_pb2.PrefillResponse(first_token_id=7, kv_transfer_params=b"params")
    after = decode_message(request, prefilled=first)
    resumed = decode_message(request, resume_output_token_ids=[7, 8])
    whole = decode_message(request)
    for msg in (prefill, after, resumed, whole):
        assert (msg.request_id, list(msg.prompt_token_ids), msg.cache_salt) == ("pdkv-1", [1, 2, 3], "salt")
        assert convert.sampling_params(msg.sampling) == request.params
    assert (after.first_token_id, after.kv_transfer_params) == (7, b"params")
    assert [carried_tokens(m) for m in (after, resumed, whole)] == [[7], [7, 8], []]
    assert not resumed.HasField("first_token_id") and not whole.HasField("first_token_id")


def test_prompt_usage_is_the_client_prompt_s_computed_on_the_node() -> None:
    """A decode node's prompt also holds the tokens it was handed; its figures are cut to the client's."""

    def out(prompt: int, cached: int, external: int) -> RequestOutput:
        return RequestOutput("r", [], "", [], False, num_prompt_tokens=prompt, num_cached_tokens=cached,
                             num_external_tokens=external)  # fmt: skip

    u = convert.prompt_usage(out(40, 16, 16))
    assert (u.prompt_tokens, u.local_prefix_tokens, u.external_tokens, u.computed_tokens) == (40, 16, 16, 8)
    after_prefill = convert.prompt_usage(out(33, 0, 32), carried=1)  # prompt 32 + the first token
    assert (after_prefill.prompt_tokens, after_prefill.external_tokens, after_prefill.computed_tokens) == (
        32,
        32,
        0,
    )
    resumed = convert.prompt_usage(out(40, 36, 0), carried=8)  # its prefix hit covers resumed tokens too
    assert (resumed.prompt_tokens, resumed.local_prefix_tokens, resumed.computed_tokens) == (32, 32, 0)
