"""Tool calls, the request side, through the one admission path: the template family read from each real
template (Qwen2.5's hermes, Llama 3.1's JSON, a ChatML template that renders no tools), the conversation
rendered as transformers renders it, the generic format's system message, the constraint of ``required``
and a named function (it accepts a valid call and nothing else), and every bad input a 400 / an
INVALID_ARGUMENT naming its field -- the same from HTTP and gRPC."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from fastapi.testclient import TestClient

from pdkv_proto.pdkv.v1 import generation_pb2
from router.admission import Admission, AdmittedRequest, InvalidField
from router.auth import OPEN, Caller
from router.openai_api import create_app
from router.openai_requests import chat_request
from router.openai_schema import ChatCompletionRequest
from router.servicer import generation_request
from router.tokenizer import RouterModel, load_model
from router.tool_calls import NO_PARAMETERS
from tests.chat_templates import LLAMA31, QWEN25
from tests.gguf_models import CHATML, write_gguf
from tests.tiny_models import pdkv_tiny_model_dir

CALLER = Caller(OPEN, "peer:test", 8, cache_details=False)
WEATHER_ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 12}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_ARGS},
}
TIME = {"type": "function", "function": {"name": "get_time"}}  # no parameters: takes none
USER = {"role": "user", "content": "Weather in Paris?"}
CALL = {
    "id": "call_1",
    "type": "function",
    "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "c"}'},
}
HISTORY = [
    USER,
    {"role": "assistant", "content": None, "tool_calls": [CALL]},
    {"role": "tool", "tool_call_id": "call_1", "content": "18C"},
]
TEMPLATES = {"hermes": QWEN25, "llama3_json": LLAMA31, "generic": CHATML}


@pytest.fixture(scope="module")
def models(tmp_path_factory: pytest.TempPathFactory) -> dict[str, RouterModel]:
    folder: Path = tmp_path_factory.mktemp("tools")
    return {
        fmt: load_model(
            write_gguf(pdkv_tiny_model_dir(), folder / f"{fmt}.gguf", qtype="F32", chat_template=t)
        )
        for fmt, t in TEMPLATES.items()
    }


def admit(model: RouterModel, **body: Any) -> AdmittedRequest:
    request = ChatCompletionRequest.model_validate({"model": model.name, "messages": [USER], **body})
    return Admission(model).admit(chat_request(request, model), CALLER)


def rendered(model: RouterModel, admitted: AdmittedRequest) -> str:
    return model.tokenizer.decode(admitted.prompt_token_ids, skip_special_tokens=False)


def test_the_format_is_read_from_the_template(models: dict[str, RouterModel]) -> None:
    for fmt, model in models.items():
        assert Admission(model).tool_format == fmt


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json"])
def test_a_template_that_renders_tools_gets_them_as_transformers_hands_them(
    models: dict[str, RouterModel], fmt: str
) -> None:
    """The tools and the history's call and result reach the template: the prompt is transformers' own
    rendering of the same conversation (the call's arguments a dict, the result's tool_call_id kept)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    model = models[fmt]
    admitted = admit(model, messages=HISTORY, tools=[WEATHER, TIME])
    hf_history = json.loads(json.dumps(HISTORY))
    hf_history[1]["content"] = ""
    hf_history[1]["tool_calls"][0]["function"]["arguments"] = {"city": "Paris", "unit": "c"}
    hf_tools = [
        WEATHER,
        {
            "type": "function",
            "function": {"name": "get_time", "parameters": NO_PARAMETERS},  # what "no parameters" enforces
        },
    ]
    (want,), _ = render_jinja_template(
        [hf_history],
        tools=hf_tools,
        chat_template=TEMPLATES[fmt],
        add_generation_prompt=True,
        bos_token="<|im_start|>",
        eos_token="<|im_end|>",
    )
    text = rendered(model, admitted)
    assert text == want
    if fmt == "hermes":
        assert (
            '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}\n</tool_call>'
            in text
        )
        assert "<tool_response>\n18C\n</tool_response>" in text and '"name": "get_time"' in text
    else:
        assert '{"name": "get_weather", "parameters": {"city": "Paris", "unit": "c"}}' in text
        assert "Environment: ipython" in text


def test_the_generic_format_describes_the_tools_in_a_system_message(models: dict[str, RouterModel]) -> None:
    model = models["generic"]
    text = rendered(model, admit(model, messages=HISTORY, tools=[WEATHER, TIME]))
    assert text.startswith("<|im_start|>system\nYou can call the following tools")
    assert (
        json.dumps({"name": "get_weather", "description": "Weather in a city", "parameters": WEATHER_ARGS})
        in text
    )
    assert "If no tool is needed, answer in plain text instead." in text
    call = '{"name": "get_weather", "arguments": {"city": "Paris", "unit": "c"}}'
    assert f"<|im_start|>assistant\n{call}<|im_end|>" in text
    assert '<|im_start|>tool\n{"tool_call_id": "call_1", "name": "get_weather", "content": "18C"}' in text
    with_system = [{"role": "system", "content": "Be brief."}, USER]
    text = rendered(model, admit(model, messages=with_system, tools=[TIME], tool_choice="required"))
    assert (
        text.startswith("<|im_start|>system\nBe brief.\n\nYou can call")
        and "You must call a tool now." in text
    )
    named = admit(
        model, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    assert 'You must call the tool "get_time" now.' in rendered(model, named)


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "generic"])
def test_none_shows_no_tools_and_reads_no_calls(models: dict[str, RouterModel], fmt: str) -> None:
    model = models[fmt]
    admitted = admit(model, tools=[WEATHER], tool_choice="none")
    plain = admit(model)
    assert admitted.prompt_token_ids == plain.prompt_token_ids
    assert admitted.tools is None and admitted.params.structured is None
    auto = admit(model, tools=[WEATHER])
    assert auto.tools is not None and auto.params.structured is None  # auto: parsed, not constrained


PARIS = '{"city": "Paris", "unit": "c"}'
VALID = {
    "hermes": f'<tool_call>\n{{"name": "get_weather", "arguments": {PARIS}}}\n</tool_call>',
    "llama3_json": f'{{"name": "get_weather", "parameters": {PARIS}}}',
    "generic": f'{{"name": "get_weather", "arguments": {PARIS}}}',
}


def follows(model: RouterModel, admitted: AdmittedRequest, text: str) -> bool:
    """Whether ``text`` then EOS is a complete output under the request's constraint."""
    spec = admitted.params.structured
    assert spec is not None
    matcher = Admission(model).grammars.matcher(spec)
    eos = model.eos_token_ids[0]
    return matcher.consume([*model.tokenizer.encode(text, add_special_tokens=False), eos])


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "generic"])
def test_required_and_a_named_function_constrain_the_call(models: dict[str, RouterModel], fmt: str) -> None:
    model = models[fmt]
    required = admit(model, tools=[WEATHER, TIME], tool_choice="required", parallel_tool_calls=False)
    assert required.params.structured is not None and required.params.structured.kind == "grammar"
    assert required.tools is not None and required.tools.format == fmt
    valid = VALID[fmt]
    assert follows(model, required, valid)
    assert not follows(model, required, valid.replace('"c"', '"kelvin"'))  # not in the enum
    assert not follows(model, required, valid.replace("get_weather", "get_wind"))  # not a tool
    assert not follows(model, required, "Sure, here is the weather.")  # prose is not a call
    named = admit(
        model, tools=[WEATHER, TIME], tool_choice={"type": "function", "function": {"name": "get_time"}}
    )
    assert not follows(model, named, valid)  # another function
    key = "parameters" if fmt == "llama3_json" else "arguments"
    time_call = json.dumps({"name": "get_time", key: {}})
    assert follows(model, named, f"<tool_call>\n{time_call}\n</tool_call>" if fmt == "hermes" else time_call)
    assert not follows(model, named, valid.replace("get_weather", "get_time"))  # arguments the schema lacks
    if fmt != "llama3_json":  # required with parallel calls: several
        parallel = admit(model, tools=[WEATHER, TIME], tool_choice="required")
        two = f"{valid}\n{valid}" if fmt == "hermes" else f"[{valid}, {valid}]"
        assert follows(model, parallel, two) and not follows(model, required, two)


@pytest.mark.parametrize("fmt", ["hermes", "llama3_json", "generic"])
def test_parameters_that_leave_the_type_open_take_an_object_of_arguments(
    models: dict[str, RouterModel], fmt: str
) -> None:
    """``"parameters": {}`` (a common client spelling) under ``required``: the grammar let any JSON
    through as the arguments -- the model wrote a string, the reply parser read no call, and the client
    got content and finish_reason "stop" where a call was promised."""
    model = models[fmt]
    key = "parameters" if fmt == "llama3_json" else "arguments"
    for parameters in ({}, {"type": ["object", "null"]}, {"properties": {"x": {"type": "integer"}}}):
        tool = {"type": "function", "function": {"name": "f", "parameters": parameters}}
        named = admit(model, tools=[tool], tool_choice={"type": "function", "function": {"name": "f"}})
        for arguments, ok in (({"x": 1}, True), ("f", False), ([1, 2], False), (None, False)):
            call = json.dumps({"name": "f", key: arguments})
            text = f"<tool_call>\n{call}\n</tool_call>" if fmt == "hermes" else call
            assert follows(model, named, text) is ok, (parameters, arguments)


def test_grpc_admits_what_http_admits(models: dict[str, RouterModel]) -> None:
    model = models["hermes"]
    http = admit(model, messages=HISTORY, tools=[WEATHER], tool_choice="required", parallel_tool_calls=False)
    messages = generation_pb2.ChatMessages(
        messages=[
            generation_pb2.ChatMessage(role="user", content=USER["content"]),
            generation_pb2.ChatMessage(
                role="assistant",
                tool_calls=[
                    generation_pb2.ToolCall(
                        id="call_1", name="get_weather", arguments=CALL["function"]["arguments"]
                    )
                ],
            ),
            generation_pb2.ChatMessage(role="tool", tool_call_id="call_1", content="18C"),
        ],
        tools=[
            generation_pb2.Tool(
                name="get_weather", description="Weather in a city", parameters=json.dumps(WEATHER_ARGS)
            )
        ],
        tool_choice=generation_pb2.ToolChoice(mode=generation_pb2.TOOL_CHOICE_MODE_REQUIRED),
        parallel_tool_calls=False,
    )
    grpc = Admission(model).admit(
        generation_request(generation_pb2.GenerateRequest(messages=messages)), CALLER
    )
    assert grpc.prompt_token_ids == http.prompt_token_ids
    assert grpc.params.structured == http.params.structured and grpc.tools == http.tools


BAD: list[tuple[dict[str, Any], str]] = [
    (
        {"messages": [USER, {"role": "assistant", "tool_calls": [CALL]}, {"role": "tool", "content": "18C"}]},
        "messages.2.tool_call_id",
    ),
    (
        {"messages": [USER, {"role": "tool", "tool_call_id": "call_9", "content": "18C"}]},
        "messages.1.tool_call_id",
    ),
    ({"messages": [{**USER, "tool_call_id": "call_1"}]}, "messages.0.tool_call_id"),
    ({"messages": [{**USER, "tool_calls": [CALL]}]}, "messages.0.tool_calls"),
    (  # two calls with one id: a tool message answering it would be ambiguous
        {"messages": [USER, {"role": "assistant", "tool_calls": [CALL, CALL]}]},
        "messages.1.tool_calls.1.id",
    ),
    (  # a tool message's name (the legacy function-result shape) is the function of the call it answers
        {"messages": [*HISTORY[:2], {**HISTORY[2], "name": "get_time"}]},
        "messages.2.name",
    ),
    (
        {
            "messages": [
                USER,
                {
                    "role": "assistant",
                    "tool_calls": [{**CALL, "function": {"name": "f", "arguments": "{nope"}}],
                },
            ]
        },
        "messages.1.tool_calls.0.function.arguments",
    ),
    (
        {"messages": [USER, {"role": "assistant", "tool_calls": [{**CALL, "type": "custom"}]}]},
        "messages.1.tool_calls.0.type",
    ),
    (
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
        "tools.0.function.parameters",
    ),
    (
        {
            "tools": [
                WEATHER,
                {"type": "function", "function": {"name": "g", "parameters": {"properties": 5}}},
            ]
        },
        "tools.1.function.parameters",
    ),
    (  # a call's arguments are an object: a grammar for a string forced replies no parser reads as calls
        {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}]},
        "tools.0.function.parameters",
    ),
    (
        {
            "tools": [
                {"type": "function", "function": {"name": "f", "parameters": {"type": ["array", "null"]}}}
            ]
        },
        "tools.0.function.parameters",
    ),
    ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools.0.type"),
    ({"tools": [{"type": "function", "function": {"name": "has space"}}]}, "tools.0.function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools.1.function.name"),
    (
        {"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "get_time"}}},
        "tool_choice",
    ),
    ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": f"f{i}"}} for i in range(129)]}, "tools"),
    (
        {"messages": [USER, {"role": "assistant", "content": "no", "refusal": "I refuse"}]},
        "messages.1.refusal",
    ),
    (
        {"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
        "response_format",
    ),
]


@pytest.mark.parametrize(("extra", "param"), BAD, ids=[p for _, p in BAD])
def test_bad_tool_input_is_a_400_naming_the_field_and_the_server_keeps_serving(
    models: dict[str, RouterModel], extra: dict[str, Any], param: str
) -> None:
    model = models["hermes"]
    pipeline: Any = SimpleNamespace(max_inflight=1)  # nothing here reaches the pipeline
    with TestClient(create_app(pipeline, model, healthy=lambda: True)) as http:
        response = http.post("/v1/chat/completions", json={"model": model.name, "messages": [USER], **extra})
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == param, response.json()
        still = http.post("/tokenize", json={"messages": HISTORY, "tools": [WEATHER]})
        assert still.status_code == 200 and still.json()["count"] > 0


def test_call_ids_may_repeat_across_turns_and_a_result_answers_the_nearest_call(
    models: dict[str, RouterModel],
) -> None:
    """A review's find: ids refused across turns broke clients that number each turn's calls from
    call_0 again (only one message's calls must differ).  Each result answers the nearest earlier call
    with its id, and the generic format writes that call's function -- not the last one's with the id;
    a tool message may name it (the legacy shape), which adds nothing to the prompt."""
    model = models["generic"]
    second = {**CALL, "function": {"name": "get_time", "arguments": "{}"}}
    messages = [
        *HISTORY,
        {"role": "user", "content": "And the time?"},
        {"role": "assistant", "tool_calls": [second]},
        {"role": "tool", "tool_call_id": "call_1", "content": "noon", "name": "get_time"},
    ]
    body = {"messages": messages, "tools": [WEATHER, TIME]}
    text = model.tokenizer.decode(admit(model, **body).prompt_token_ids)
    assert '{"tool_call_id": "call_1", "name": "get_weather", "content": "18C"}' in text
    assert '{"tool_call_id": "call_1", "name": "get_time", "content": "noon"}' in text
    unnamed = [*messages[:-1], {k: v for k, v in messages[-1].items() if k != "name"}]
    assert (
        admit(model, **{**body, "messages": unnamed}).prompt_token_ids
        == admit(model, **body).prompt_token_ids
    )


def test_tools_count_toward_the_size_check_only_where_they_are_shown(models: dict[str, RouterModel]) -> None:
    """A review's find: tools never rendered (tool_choice none) made a request "too long"; tools that
    could never be shown are refused before any schema is compiled."""
    model = models["generic"]
    limit = 2 * Admission(model).context_length * model.tokenizer.max_token_chars
    big = {"type": "function", "function": {"name": "f", "description": "d" * (limit // 2)}}
    shown = {"messages": [{**USER, "content": "y" * (limit // 2)}], "tools": [big]}
    with pytest.raises(InvalidField, match="characters: more than max_model_len"):
        admit(model, **shown)
    with pytest.raises(InvalidField, match="tokens, more than max_model_len"):  # tokenized: not hopeless
        admit(model, **{**shown, "tool_choice": "none"})
    huge = {"type": "function", "function": {"name": "f", "description": "d" * (limit + 1)}}
    with pytest.raises(InvalidField, match="characters") as refused:
        admit(model, tools=[huge], tool_choice="none")
    assert refused.value.field == "tools"


@pytest.mark.parametrize("fmt", ["generic", "hermes"])
def test_a_name_the_template_drops_is_a_400_naming_the_client_s_message(
    models: dict[str, RouterModel], fmt: str
) -> None:
    """An outside probe's find: a message's ``name`` was accepted and dropped.  Neither template shows
    names: the 400 names the client's message -- not the index the generic format's tools message (put
    first) moved it to."""
    model = models[fmt]
    pipeline: Any = SimpleNamespace(max_inflight=1)
    body = {"model": model.name, "messages": [{**USER, "name": "Ada"}], "tools": [WEATHER]}
    with TestClient(create_app(pipeline, model, healthy=lambda: True)) as http:
        response = http.post("/v1/chat/completions", json=body)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "messages.0.name", response.json()
        assert "does not show a user message's name" in response.json()["error"]["message"]


@pytest.mark.parametrize(
    ("messages", "field"),
    [
        (
            generation_pb2.ChatMessages(messages=[generation_pb2.ChatMessage(role="tool", content="18C")]),
            "prompt.messages.messages[0].tool_call_id",
        ),
        (
            generation_pb2.ChatMessages(
                messages=[generation_pb2.ChatMessage(role="user", content="hi")],
                tools=[generation_pb2.Tool(name="f", parameters='{"type": "nope"}')],
            ),
            "prompt.messages.tools[0].parameters",
        ),
        (
            generation_pb2.ChatMessages(
                messages=[generation_pb2.ChatMessage(role="user", content="hi")],
                tools=[generation_pb2.Tool(name="f")],
                tool_choice=generation_pb2.ToolChoice(function="g"),
            ),
            "prompt.messages.tool_choice",
        ),
        (
            generation_pb2.ChatMessages(
                messages=[
                    generation_pb2.ChatMessage(role="user", content="hi"),
                    generation_pb2.ChatMessage(
                        role="assistant",
                        tool_calls=[generation_pb2.ToolCall(id="c", name="f", arguments="[]")],
                    ),
                ]
            ),
            "prompt.messages.messages[1].tool_calls[0].arguments",
        ),
    ],
)
def test_bad_tool_input_on_grpc_names_the_field(
    models: dict[str, RouterModel], messages: generation_pb2.ChatMessages, field: str
) -> None:
    with pytest.raises(InvalidField) as info:
        Admission(models["hermes"]).admit(
            generation_request(generation_pb2.GenerateRequest(messages=messages)), CALLER
        )
    assert info.value.field == field, info.value.message


def test_the_sdks_reply_message_dumped_whole_is_accepted_back(models: dict[str, RouterModel]) -> None:
    """``messages.append(reply.message.model_dump())`` sends refusal, audio, function_call and annotations
    as null: accepted at those values (a refusal that is set is a 400, above)."""
    from openai.types.chat import ChatCompletionMessage

    message = ChatCompletionMessage.model_validate(
        {"role": "assistant", "content": None, "tool_calls": [CALL]}
    )
    dumped = message.model_dump()
    assert {"refusal", "audio", "function_call", "annotations"} <= set(dumped)
    history = [USER, dumped, {"role": "tool", "tool_call_id": "call_1", "content": "18C"}]
    model = models["hermes"]
    assert rendered(model, admit(model, messages=history, tools=[WEATHER])) == rendered(
        model, admit(model, messages=HISTORY, tools=[WEATHER])
    )
