"""Tool calls, the reply side: each format's output read into ``tool_calls`` and content (crafted outputs:
a random test model does not call tools on its own under ``auto``), streamed exactly as it is read whole,
and in OpenAI's shapes -- checked with the ``openai`` SDK's own stream accumulator."""

from __future__ import annotations

import json
import re
from types import SimpleNamespace
from typing import Any

import pytest

from router.events import Delta, Done, Usage
from router.openai_responses import ResponseShape
from router.tool_calls import ToolFormat
from router.tool_parser import ParsedReply, ToolParser

NAMES = frozenset({"get_weather", "get_time"})
HERMES_TWO = (
    "Let me look.\n<tool_call>\n"
    '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
    '{"name": "get_time", "arguments": {"tz": 1}}\n</tool_call>'
)


def parse(fmt: ToolFormat, text: str, parallel: bool = True) -> ParsedReply:
    return ToolParser(fmt, NAMES, parallel).parse(text)


def calls(reply: ParsedReply) -> list[tuple[str, Any]]:
    return [(c.name, json.loads(c.arguments)) for c in reply.calls]


def test_hermes_calls_with_content_before_them() -> None:
    reply = parse("hermes", HERMES_TWO)
    assert calls(reply) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": 1})]
    assert reply.content == "Let me look."
    assert all(re.fullmatch(r"call_[0-9a-f]{24}", c.id) for c in reply.calls)
    assert len({c.id for c in reply.calls}) == 2


@pytest.mark.parametrize(
    ("fmt", "text", "want"),
    [
        (
            "hermes",
            '<tool_call>\n{"name": "get_time", "arguments": {"tz": 2}}\n</tool_call>',
            [("get_time", {"tz": 2})],
        ),
        (
            "hermes",
            '<tool_call>{"name": "get_time", "arguments": "{\\"tz\\": 2}"}',
            [("get_time", {"tz": 2})],
        ),
        ("llama3_json", '{"name": "get_time", "parameters": {"tz": 3}}', [("get_time", {"tz": 3})]),
        (
            "llama3_json",
            '<|python_tag|>{"name": "get_time", "parameters": {"tz": 3}}',
            [("get_time", {"tz": 3})],
        ),
        (
            "llama3_json",
            '{"name": "get_time", "parameters": {"tz": 3}}; {"name": "get_weather", "parameters": {}}',
            [("get_time", {"tz": 3}), ("get_weather", {})],
        ),
        ("generic", '{"name": "get_time", "arguments": {"tz": 4}}', [("get_time", {"tz": 4})]),
        (
            "generic",
            ' [{"name": "get_time", "arguments": {"tz": 4}}, '
            '{"name": "get_weather", "arguments": {"city": "Oslo"}}]\n',
            [("get_time", {"tz": 4}), ("get_weather", {"city": "Oslo"})],
        ),
    ],
)
def test_each_format_reads_its_calls(fmt: ToolFormat, text: str, want: list) -> None:
    reply = parse(fmt, text)
    assert calls(reply) == want and reply.content is None


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("hermes", '<tool_call>\n{"name": "get_time", "arguments": {"tz": 2}\n</tool_call>'),  # a brace short
        ("hermes", '<tool_call>\n{"name": "rm_rf", "arguments": {}}\n</tool_call>'),  # not a tool
        ("hermes", '<tool_call>\n{"name": "get_time", "arguments": [1]}\n</tool_call>'),  # not an object
        ("hermes", "I would use <tool_ and <tool_call but not really"),
        ("llama3_json", '{"name": "get_time", "parameters": {"tz": 3}} and then some prose'),
        ("llama3_json", 'The answer is {"name": "get_time", "parameters": {"tz": 3}}'),
        ("llama3_json", '{"name": "get_time", "parameters": {"tz": 3}}; {"name": "nope", "parameters": {}}'),
        ("generic", '{"name": "get_time", "arguments": {"tz": 4}'),
        ("generic", '{"city": "Paris"}'),
        ("generic", "[]"),
        ("generic", "Hello! {curly} text"),
    ],
)
def test_malformed_calls_stay_content_as_written(fmt: ToolFormat, text: str) -> None:
    reply = parse(fmt, text)
    assert reply.calls == () and reply.content == text


GENERIC_CALL = '{"name": "get_weather", "arguments": {"city": "Oslo"}}'
LLAMA_CALL = '{"name": "get_weather", "parameters": {"city": "Oslo"}}'
CUT_REPLIES = [  # (format, the reply cut by max_tokens, the cut call the content keeps)
    ("generic", f"[{GENERIC_CALL}, " + '{"name": "get_time", "argumen', '{"name": "get_time", "argumen'),
    (
        "generic",
        f"[{GENERIC_CALL}, " + '{"name": "get_time", "arguments": {"tz": tr',
        '{"name": "get_time", "arguments": {"tz": tr',
    ),
    ("generic", f"[{GENERIC_CALL}, " + '{"name": "get_time"', '{"name": "get_time"'),
    ("generic", f"[{GENERIC_CALL},", ""),
    ("generic", f"[{GENERIC_CALL}", ""),
    (
        "llama3_json",
        f"{LLAMA_CALL}; " + '{"name": "get_time", "parameters": {"tz": 1',
        '{"name": "get_time", "parameters": {"tz": 1',
    ),
    ("llama3_json", f"<|python_tag|>{LLAMA_CALL};", ""),
]


@pytest.mark.parametrize(("fmt", "text", "rest"), CUT_REPLIES)
def test_a_reply_cut_by_max_tokens_keeps_its_complete_calls(fmt: ToolFormat, text: str, rest: str) -> None:
    """An outside probe's find: a list of calls cut short by max_tokens (tool_choice "required" writes
    calls until the limit) came back as content only, its complete calls lost (docs/tool_calls.md: "its
    complete calls are still returned").  The cut call stays content, as the model wrote it."""
    reply = parse(fmt, text)
    assert calls(reply) == [("get_weather", {"city": "Oslo"})]
    assert reply.content == (rest or None)


@pytest.mark.parametrize(
    "text",
    [
        f"[{GENERIC_CALL}, " + '{"name": x}]',  # malformed, not cut
        f"[{GENERIC_CALL}] and prose",
        '[{"name": "rm_rf", "arguments": {}}, ' + GENERIC_CALL[:20],  # a complete value that is no call
        "[",
    ],
)
def test_a_series_broken_other_than_by_its_end_stays_content(text: str) -> None:
    reply = parse("generic", text)
    assert reply.calls == () and reply.content == text


def test_prose_keeps_every_character_and_a_bad_block_stays_among_good_ones() -> None:
    prose = "  Two lines\nof text, ending in space \n"
    assert parse("hermes", prose).content == prose and parse("generic", prose).content == prose
    text = HERMES_TWO.replace('"tz": 1}', '"tz": }')  # the second call's JSON is broken
    reply = parse("hermes", text)
    assert calls(reply) == [("get_weather", {"city": "Paris"})]
    assert (
        reply.content
        == 'Let me look.\n<tool_call>\n{"name": "get_time", "arguments": {"tz": }}\n</tool_call>'
    )


def test_without_parallel_calls_only_the_first_is_kept() -> None:
    assert calls(parse("hermes", HERMES_TWO, parallel=False)) == [("get_weather", {"city": "Paris"})]
    two = '[{"name": "get_time", "arguments": {}}, {"name": "get_weather", "arguments": {}}]'
    assert calls(parse("generic", two, parallel=False)) == [("get_time", {})]


@pytest.mark.parametrize(
    ("fmt", "text"),
    [
        ("hermes", HERMES_TWO),
        ("hermes", HERMES_TWO + "\nDone <tool_call"),
        ("hermes", HERMES_TWO.replace('"tz": 1}', '"tz": }')),
        ("llama3_json", '<|python_tag|>{"name": "get_time", "parameters": {"tz": 3}}'),
        ("llama3_json", " Plain <|python_tag|> prose"),
        ("generic", ' [{"name": "get_time", "arguments": {"tz": 4}}]'),
        ("generic", "Hello there, \n no call"),
        *((fmt, text) for fmt, text, _ in CUT_REPLIES),
    ],
)
def test_streaming_in_any_pieces_gives_what_the_whole_text_gives(fmt: ToolFormat, text: str) -> None:
    parser = ToolParser(fmt, NAMES, True)
    whole = parser.parse(text)
    for size in (1, 2, 3, 7, len(text)):
        stream = parser.stream()
        pieces = []
        for at in range(0, len(text), size):
            pieces += stream.push(text[at : at + size])
        pieces += stream.finish()
        content = "".join(p for p in pieces if isinstance(p, str))
        got = [(c.name, c.arguments) for c in pieces if not isinstance(c, str)]
        assert got == [(c.name, c.arguments) for c in whole.calls], size
        assert content == (whole.content or ""), size


def test_hermes_streams_prose_before_the_call_ends() -> None:
    stream = ToolParser("hermes", NAMES, True).stream()
    assert stream.push("Checking the <tool") == ["Checking the"]  # " <tool" could open a call
    assert stream.push('_call>\n{"name": "get_time", ') == []
    (call,) = stream.push('"arguments": {}}\n</tool_call>')
    assert not isinstance(call, str) and call.name == "get_time"


class _Model:
    name = "m"

    class tokenizer:  # stands in for the router model's tokenizer
        @staticmethod
        def decode(ids: list[int], skip_special_tokens: bool = False) -> str:
            return "".join(chr(97 + i % 26) for i in ids)

        @staticmethod
        def stream(skip_special_tokens: bool = True) -> Any:  # completions' text offsets
            return SimpleNamespace(push=lambda i: chr(97 + i % 26))

    class grammars:  # stands in for its grammar compiler's token bytes
        @staticmethod
        def token_bytes(token_id: int) -> bytes:
            return chr(97 + token_id % 26).encode()


def _shape(fmt: ToolFormat, logprobs: bool = False) -> ResponseShape:
    model: Any = _Model()
    return ResponseShape(
        model, "chatcmpl-1", created=0, chat=True, logprobs=logprobs, tools=ToolParser(fmt, NAMES, True)
    )


def _deltas(text: str, size: int) -> list[Delta]:
    return [Delta([i], text[i : i + size], [-0.5]) for i in range(0, len(text), size)]


def test_the_whole_answer_in_openai_shape() -> None:
    done = Done("stop", 2, Usage(prompt_tokens=3, completion_tokens=9))
    answer = _shape("hermes").whole([(_deltas(HERMES_TWO, 5), done)])
    choice = answer["choices"][0]
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me look."
    first = choice["message"]["tool_calls"][0]
    assert first["type"] == "function" and first["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    prose = _shape("hermes").whole([(_deltas("no call here", 4), done)])["choices"][0]
    assert prose["finish_reason"] == "stop" and "tool_calls" not in prose["message"]
    cut = _shape("hermes").whole([(_deltas(HERMES_TWO, 5), Done("length", None, Usage()))])["choices"][0]
    assert cut["finish_reason"] == "length" and len(cut["message"]["tool_calls"]) == 2
    fmt, text, rest = CUT_REPLIES[0]
    cut = _shape(fmt).whole([(_deltas(text, 5), Done("length", None, Usage()))])["choices"][0]
    assert cut["finish_reason"] == "length" and cut["message"]["content"] == rest
    assert [c["function"]["name"] for c in cut["message"]["tool_calls"]] == ["get_weather"]


def test_the_sdk_stream_accumulator_builds_the_whole_answer() -> None:
    """The chunks, fed to the openai SDK's ChatCompletionStreamState, give the message the whole answer
    gives (ids aside): index, id, type and name once per call, then its arguments."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    done = Done("stop", 2, Usage(prompt_tokens=3, completion_tokens=9))
    shape = _shape("hermes", logprobs=True)
    chunks = [shape.chunk({"role": "assistant", "content": ""}, None)]
    for delta in _deltas(HERMES_TWO, 3):
        chunks += shape.delta_chunks(delta)
    chunks += shape.final_chunks(done)
    heads = [t for c in chunks for t in c["choices"][0]["delta"].get("tool_calls", ()) if "id" in t]
    assert [h["index"] for h in heads] == [0, 1] and all(h["type"] == "function" for h in heads)
    state = ChatCompletionStreamState()
    for chunk in chunks:
        state.handle_chunk(ChatCompletionChunk.model_validate(chunk))
    final = state.get_final_completion().choices[0]
    assert final.finish_reason == "tool_calls" and final.message.content == "Let me look."
    got = [(t.function.name, json.loads(t.function.arguments)) for t in final.message.tool_calls or ()]
    assert got == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": 1})]
    assert final.logprobs is not None and len(final.logprobs.content or ()) == len(_deltas(HERMES_TWO, 3))


def test_a_non_finite_score_is_a_clear_error_not_a_bare_500_or_invalid_json() -> None:
    """A NaN logprob (a broken adapter, before the loader refused one: an outside probe's find) made the
    whole answer a 500 with no body; it is now an OpenAI-shaped error saying what happened."""
    import asyncio

    from router.http_scope import HttpCallScope
    from router.openai_errors import ApiError
    from router.openai_responses import whole_response

    class _Client:
        @staticmethod
        async def is_disconnected() -> bool:
            return False

    async def events() -> Any:
        yield Delta([1], "b", [float("nan")])
        yield Done("length", None, Usage(prompt_tokens=1, completion_tokens=1))

    model: Any = _Model()
    shape = ResponseShape(model, "cmpl-1", created=0, chat=False, logprobs=True)
    with pytest.raises(ApiError) as info:
        asyncio.run(whole_response(events(), _Client(), HttpCallScope(None), shape))
    assert info.value.status == 500 and "not a finite number" in info.value.message
