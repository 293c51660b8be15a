"""Tool calls in OpenAI's shapes: a chat body's ``tools``, ``tool_choice`` and the messages' calls as the
neutral types admission checks (``router/tool_calls.py``), and a reply's calls as OpenAI writes them --
``message.tool_calls`` whole, ``delta.tool_calls`` streamed.

A streamed call is two chunks, as the SDK's stream accumulator expects (it concatenates strings, so the
id, the type and the name come once): the first with the call's ``index``, ``id``, ``type`` and
``function.name`` (and empty ``arguments``), the second with the same ``index`` and the whole
``function.arguments``.  A call is sent once it is complete (``router/tool_parser.py`` says when).
"""

from __future__ import annotations

import json
from typing import Any

from router.openai_errors import ApiError
from router.openai_schema import ChatMessage, ToolDefinition
from router.tool_calls import ToolCall, ToolChoice, ToolSpec

_MODES = ("none", "auto", "required")


def tool_specs(tools: list[ToolDefinition] | None) -> tuple[ToolSpec, ...]:
    """The body's tools (their shape is checked by the schema; admission checks the rest)."""
    return tuple(
        ToolSpec(
            t.function.name,
            t.function.description or "",
            json.dumps(t.function.parameters) if t.function.parameters is not None else "",
            bool(t.function.strict),
        )
        for t in tools or ()
    )


def tool_choice(value: Any) -> ToolChoice | None:
    """``tool_choice`` as the neutral choice (None: unset); 400 naming it when it is no choice OpenAI's
    chat API defines."""
    if value is None:
        return None
    if isinstance(value, str) and value in _MODES:
        return ToolChoice(value)  # type: ignore[arg-type]
    if isinstance(value, dict) and value.get("type") == "function" and set(value) == {"type", "function"}:
        function = value["function"]
        if isinstance(function, dict) and set(function) == {"name"} and isinstance(function["name"], str):
            return ToolChoice("function", function["name"])
    raise ApiError.invalid(
        "tool_choice",
        f'must be "none", "auto", "required" or {{"type": "function", "function": {{"name": ...}}}}; '
        f"got {value!r}",
    )


def message_calls(message: ChatMessage) -> tuple[ToolCall, ...]:
    return tuple(ToolCall(c.id, c.function.name, c.function.arguments) for c in message.tool_calls or ())


def openai_calls(calls: tuple[ToolCall, ...]) -> list[dict[str, Any]]:
    """A reply's calls as ``message.tool_calls``."""
    return [
        {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
        for c in calls
    ]


def call_deltas(index: int, call: ToolCall) -> list[dict[str, Any]]:
    """One call as the two ``delta`` objects of its chunks (see the module docstring)."""
    head = {
        "index": index,
        "id": call.id,
        "type": "function",
        "function": {"name": call.name, "arguments": ""},
    }
    return [
        {"tool_calls": [head]},
        {"tool_calls": [{"index": index, "function": {"arguments": call.arguments}}]},
    ]
