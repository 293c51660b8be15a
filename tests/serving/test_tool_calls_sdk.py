"""Tool calls end to end, driven by the official ``openai`` SDK as a new user would drive it (and by gRPC):
a router with a prefill and a decode node whose model's template renders no tools (the generic format,
as ``pdkv up``'s embedded SmolLM2 has it), and one colocated node whose model has Qwen2.5's template
(hermes).  ``required`` and a named function give a valid call (whole, streamed and parsed into the
SDK's pydantic model), the follow-up turn carries the tool's result to the model, bad input is a 400
naming the field and the server keeps serving.  The small random models call no tool on their own, so
``auto`` is checked on crafted outputs (``tests/router/test_tool_parser.py``); here each format's
constraint is also run on the engine directly, Llama 3's included.
"""

from __future__ import annotations

import json
import typing
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import grpc
import httpx
import jsonschema
import pydantic
import pytest

from engine.llm import LLM
from pdkv.launcher import Cluster
from pdkv_proto.pdkv.v1 import generation_pb2, generation_pb2_grpc, types_pb2
from router.admission import Admission
from router.auth import OPEN, Caller
from router.openai_requests import chat_request
from router.openai_schema import ChatCompletionRequest
from router.tokenizer import load_model
from tests.chat_templates import LLAMA31, QWEN25
from tests.gguf_models import CHATML, write_gguf
from tests.serving.helpers import NODE_ARGS, assert_node_idle, start_cluster
from tests.tiny_models import pdkv_tiny_model_dir

openai = pytest.importorskip("openai")

WEATHER_ARGS = {
    "type": "object",
    "properties": {"city": {"type": "string", "maxLength": 8}, "unit": {"enum": ["c", "f"]}},
    "required": ["city", "unit"],
    "additionalProperties": False,
}
TZ_ARGS = {
    "type": "object",
    "properties": {"offset": {"type": "integer", "minimum": -12, "maximum": 12}},
    "required": ["offset"],
    "additionalProperties": False,
}
TOOLS: list[Any] = [
    {
        "type": "function",
        "function": {"name": "get_weather", "description": "Weather", "parameters": WEATHER_ARGS},
    },
    {
        "type": "function",
        "function": {"name": "get_time", "description": "Time in a zone", "parameters": TZ_ARGS},
    },
]
SCHEMAS = {"get_weather": WEATHER_ARGS, "get_time": TZ_ARGS}
QUESTION = [{"role": "user", "content": "What is the weather in Paris?"}]


class GetWeather(pydantic.BaseModel):
    """The weather in a city."""

    city: str = pydantic.Field(max_length=8)
    unit: typing.Literal["c", "f"]


def valid_call(call: Any) -> dict[str, Any]:
    """The call's arguments, checked against its tool's schema."""
    assert call.type == "function" and call.id.startswith("call_")
    arguments = json.loads(call.function.arguments)
    jsonschema.validate(arguments, SCHEMAS[call.function.name])
    return arguments


@pytest.fixture(scope="module", params=["disaggregated-generic", "colocated-hermes"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Cluster]:
    mode, fmt = request.param.split("-")
    template = QWEN25 if fmt == "hermes" else CHATML
    path = write_gguf(
        pdkv_tiny_model_dir(),
        tmp_path_factory.mktemp(fmt) / f"tiny-{fmt}.gguf",
        qtype="F32",
        chat_template=template,
    )
    topology: dict[str, Any] = {
        "mode": mode,
        "num_prefill": 1 if mode == "disaggregated" else 0,
        "num_decode": 1,
    }
    c = start_cluster(model=str(path), node_args=(*NODE_ARGS, "--dtype", "float32"), **topology)
    try:
        yield c
    finally:
        c.stop()


@pytest.fixture(scope="module")
def client(cluster: Cluster) -> Iterator[Any]:
    assert cluster.http_address is not None
    with openai.OpenAI(base_url=f"http://{cluster.http_address}/v1", api_key="unused", max_retries=0) as c:
        yield c


def model_name(client: Any) -> str:
    return str(client.models.list().data[0].id)


def test_required_and_named_calls_whole(client: Any) -> None:
    name = model_name(client)
    r = client.chat.completions.create(
        model=name,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
    )
    choice = r.choices[0]
    assert choice.finish_reason == "tool_calls" and choice.message.content is None
    (call,) = choice.message.tool_calls
    valid_call(call)
    named = {"type": "function", "function": {"name": "get_time"}}
    r = client.chat.completions.create(
        model=name, messages=QUESTION, tools=TOOLS, tool_choice=named, max_tokens=200, temperature=0
    )
    (call,) = r.choices[0].message.tool_calls
    assert call.function.name == "get_time" and -12 <= valid_call(call)["offset"] <= 12
    several = client.chat.completions.create(
        model=name, messages=QUESTION, tools=TOOLS, tool_choice="required", max_tokens=300
    )
    calls = several.choices[0].message.tool_calls  # parallel calls allowed: one or more, each valid
    assert calls and all(valid_call(c) is not None for c in calls)


def test_named_call_parsed_into_the_sdk_model_whole_and_streamed(client: Any) -> None:
    name = model_name(client)
    tool = openai.pydantic_function_tool(GetWeather)
    choice = {"type": "function", "function": {"name": "GetWeather"}}
    parsed = client.chat.completions.parse(
        model=name, messages=QUESTION, tools=[tool], tool_choice=choice, max_tokens=200
    )
    (call,) = parsed.choices[0].message.tool_calls
    assert isinstance(call.function.parsed_arguments, GetWeather)
    with client.chat.completions.stream(
        model=name, messages=QUESTION, tools=[tool], tool_choice=choice, max_tokens=200
    ) as stream:
        events = [e.type for e in stream]
        final = stream.get_final_completion()
    assert "tool_calls.function.arguments.done" in events
    (call,) = final.choices[0].message.tool_calls
    assert final.choices[0].finish_reason == "tool_calls"
    assert isinstance(call.function.parsed_arguments, GetWeather) and call.id.startswith("call_")


def test_required_call_streamed_as_delta_tool_calls(client: Any) -> None:
    with client.chat.completions.create(
        model=model_name(client),
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
        stream=True,
    ) as stream:
        deltas = [c.choices[0] for c in stream if c.choices]
    parts = [t for d in deltas for t in d.delta.tool_calls or ()]
    head, *rest = parts
    assert head.index == 0 and head.id.startswith("call_") and head.type == "function" and head.function.name
    assert all(p.index == 0 and p.id is None and p.function.name is None for p in rest)
    arguments = "".join(p.function.arguments or "" for p in parts)
    jsonschema.validate(json.loads(arguments), SCHEMAS[head.function.name])
    assert deltas[-1].finish_reason == "tool_calls"
    assert not "".join(d.delta.content or "" for d in deltas)


def test_follow_up_turn_with_the_tool_result(client: Any, cluster: Cluster) -> None:
    """The assistant's call (the SDK's own message object) and the tool's result go back; the model reads
    them: the prompt is the one /tokenize renders, and holds the result."""
    name = model_name(client)
    first = client.chat.completions.create(
        model=name,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        parallel_tool_calls=False,
        max_tokens=200,
    )
    message = first.choices[0].message
    (call,) = message.tool_calls
    history = [*QUESTION, message, {"role": "tool", "tool_call_id": call.id, "content": "18 degrees, sunny"}]
    r = client.chat.completions.create(model=name, messages=history, tools=TOOLS, max_tokens=8, temperature=0)
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    sent = [m if isinstance(m, dict) else m.model_dump(exclude_none=True) for m in history]
    rendered = httpx.post(
        f"http://{cluster.http_address}/tokenize",
        json={"messages": sent, "tools": TOOLS, "return_token_strs": True},
    ).json()
    assert r.usage.prompt_tokens == rendered["count"]
    prompt = "".join(rendered["token_strs"])
    assert "18 degrees, sunny" in prompt and call.function.arguments in prompt
    plain = client.chat.completions.create(
        model=name, messages=history, tools=TOOLS, tool_choice="none", max_tokens=8
    )
    assert plain.choices[0].message.tool_calls is None and isinstance(plain.choices[0].message.content, str)


def test_bad_tool_input_is_a_400_naming_the_field_and_the_cluster_keeps_serving(
    client: Any, cluster: Cluster
) -> None:
    name = model_name(client)
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    bad: list[tuple[dict[str, Any], str]] = [
        (
            {
                "messages": [
                    *QUESTION,
                    {"role": "assistant", "tool_calls": [call]},
                    {"role": "tool", "content": "x"},
                ]
            },
            "messages.2.tool_call_id",
        ),
        (
            {"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]},
            "tools.0.function.parameters",
        ),
        (
            {"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "get_wind"}}},
            "tool_choice",
        ),
        ({"tools": [{"type": "custom", "custom": {"name": "f"}}]}, "tools.0.type"),
    ]
    for extra, param in bad:
        with pytest.raises(openai.BadRequestError) as info:
            client.chat.completions.create(**{"model": name, "messages": QUESTION, "max_tokens": 4, **extra})
        assert info.value.body["param"] == param, info.value.body
    r = client.chat.completions.create(
        model=name,
        messages=QUESTION,
        tools=TOOLS,
        tool_choice="required",
        max_tokens=200,
        parallel_tool_calls=False,
    )
    assert r.choices[0].message.tool_calls
    for node in cluster.prefill_nodes + cluster.decode_nodes:
        assert_node_idle(node.address, timeout=10.0)


def test_grpc_serves_tool_calls(cluster: Cluster) -> None:
    with grpc.insecure_channel(cluster.router_address) as channel:
        stub = generation_pb2_grpc.GenerationStub(channel)
        info = stub.GetModelInfo(generation_pb2.GetModelInfoRequest(), timeout=10)
        assert info.tool_calls and info.tool_call_format in ("generic", "hermes")
        messages = generation_pb2.ChatMessages(
            messages=[generation_pb2.ChatMessage(role="user", content=QUESTION[0]["content"])],
            tools=[generation_pb2.Tool(name="get_time", parameters=json.dumps(TZ_ARGS))],
            tool_choice=generation_pb2.ToolChoice(function="get_time"),
        )
        request = generation_pb2.GenerateRequest(messages=messages)
        request.sampling.max_tokens = 200
        done = next(r.done for r in stub.Generate(request, timeout=60) if r.HasField("done"))
        unary = stub.GenerateUnary(request, timeout=60).done
    for completion in (done, unary):
        assert completion.finish_reason == types_pb2.FINISH_REASON_TOOL_CALLS
        (call,) = completion.tool_calls
        assert call.name == "get_time" and completion.content == ""
        jsonschema.validate(json.loads(call.arguments), TZ_ARGS)


@pytest.mark.parametrize(
    ("fmt", "template"), [("hermes", QWEN25), ("llama3_json", LLAMA31), ("generic", CHATML)]
)
def test_each_format_constrains_a_valid_call_on_the_engine(tmp_path: Path, fmt: str, template: str) -> None:
    """Admission's prompt and constraint, run on the engine, give a call its parser reads back."""
    path = write_gguf(pdkv_tiny_model_dir(), tmp_path / f"{fmt}.gguf", qtype="F32", chat_template=template)
    model = load_model(path)
    llm = LLM(path, device="cpu", dtype="float32", num_blocks=256)
    for choice in ("required", {"type": "function", "function": {"name": "get_time"}}):
        body = ChatCompletionRequest.model_validate(
            {"model": model.name, "messages": QUESTION, "tools": TOOLS, "tool_choice": choice,
             "parallel_tool_calls": False, "max_tokens": 200, "temperature": 0}
        )  # fmt: skip
        admitted = Admission(model).admit(
            chat_request(body, model), Caller(OPEN, "p", 8, cache_details=False)
        )
        assert admitted.tools is not None and admitted.tools.format == fmt
        out = llm.generate([admitted.prompt_token_ids], admitted.params)[0]
        reply = admitted.tools.parse(out.text)
        assert out.finish_reason == "stop" and reply.content is None, out.text
        (call,) = reply.calls
        jsonschema.validate(json.loads(call.arguments), SCHEMAS[call.name])
        assert choice == "required" or call.name == "get_time"
