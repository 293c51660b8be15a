"""Tool calls, what the model sees and may write: the conversation and the tools handed to the chat
template, the generic format's system message, and the constraint that enforces ``required`` and a named
function (``router/tool_calls.py`` says which format a template has).

Templates that render tools (hermes, llama3_json) get them as Hugging Face hands them: ``tools=`` in
OpenAI's shape; an assistant message's ``tool_calls`` with each call's ``arguments`` as a dict (the
templates write ``arguments | tojson``: a string would come out quoted twice); a tool message's
``tool_call_id``.  A template that does not (generic) gets the same information in the messages
themselves: a system message describing the tools and the answer's format (after the client's first
system message, or as a new first message), an assistant's calls as that format's JSON after its text,
a tool result (role ``tool``) as a JSON object naming the call it answers (``tool_call_id``, ``name``).
Under ``tool_choice: none`` the tools are not shown (the model is not to call one); the history's calls
and results still are.

The constraint is a Lark grammar for llguidance whose JSON part is the tools' own schemas (``%json``), so
the arguments validate against each function's ``parameters``:

    hermes        <tool_call>\\n{"name": "f", "arguments": {...}}\\n</tool_call>
                  (required with parallel calls: one or more, separated by "\\n", as Qwen2.5 writes them)
    llama3_json   {"name": "f", "parameters": {...}}
                  (always one: Llama 3's template renders one call per assistant turn)
    generic       {"name": "f", "arguments": {...}}
                  (required with parallel calls: that, or a JSON list of one or more of them)

A named function is exactly one call of it.  JSON is written as OpenAI's strict mode writes it.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from typing import Any, Protocol

from engine.structured import JSON_STYLE, StructuredOutput
from router.tool_calls import ToolCall, ToolFormat, ToolPlan


class Turn(Protocol):
    """What the template's messages are made of (``router.admission.ChatTurn`` has it)."""

    @property
    def role(self) -> str: ...
    @property
    def content(self) -> str: ...
    @property
    def name(self) -> str | None: ...
    @property
    def tool_calls(self) -> tuple[ToolCall, ...]: ...
    @property
    def tool_call_id(self) -> str | None: ...


def template_inputs(
    turns: Sequence[Turn], fmt: ToolFormat | None, plan: ToolPlan | None, answers: Mapping[int, str]
) -> tuple[list[dict[str, Any]], list[dict[str, Any]] | None]:
    """The messages and the ``tools`` argument the template renders.  ``answers``: each tool message's
    index with the function it answers (``check_history``; a generic tool result names it).  A tool
    message's ``name`` is that function (checked): the generic result writes it, an HF template gets the
    message without it (the call it answers says as much)."""
    shown = plan if plan is not None and plan.calls_allowed else None
    if fmt in ("hermes", "llama3_json"):
        tools = [_openai_tool(shown, t.name) for t in shown.tools] if shown is not None else None
        return [_hf_message(t) for t in turns], tools
    messages = [_generic_message(t, answers.get(i, "")) for i, t in enumerate(turns)]
    if shown is not None:
        text = generic_instructions(shown)
        if messages and messages[0]["role"] == "system":
            messages[0]["content"] = f"{messages[0]['content']}\n\n{text}"
        else:
            messages.insert(0, {"role": "system", "content": text})
    return messages, None


def _openai_tool(plan: ToolPlan, name: str) -> dict[str, Any]:
    spec = next(t for t in plan.tools if t.name == name)
    function: dict[str, Any] = {"name": name}
    if spec.description:
        function["description"] = spec.description
    function["parameters"] = plan.schemas[name]
    return {"type": "function", "function": function}


def _hf_message(turn: Turn) -> dict[str, Any]:
    message: dict[str, Any] = {"role": turn.role, "content": turn.content}
    if turn.name and turn.role != "tool":
        message["name"] = turn.name
    if turn.tool_calls:
        message["tool_calls"] = [
            {
                "id": c.id,
                "type": "function",
                "function": {"name": c.name, "arguments": json.loads(c.arguments)},
            }
            for c in turn.tool_calls
        ]
    if turn.tool_call_id:
        message["tool_call_id"] = turn.tool_call_id
    return message


def _generic_message(turn: Turn, function: str) -> dict[str, Any]:
    """The turn with its calls and result written into its content (the template renders no tool keys;
    one that renders them in a syntax pdkv does not parse is not handed them, so nothing is written
    twice)."""
    message: dict[str, Any] = {"role": turn.role, "content": turn.content}
    if turn.name and turn.role != "tool":
        message["name"] = turn.name
    if turn.tool_calls:
        calls = [{"name": c.name, "arguments": json.loads(c.arguments)} for c in turn.tool_calls]
        written = _dumps(calls[0] if len(calls) == 1 else calls)
        message["content"] = f"{turn.content}\n{written}" if turn.content else written
    if turn.tool_call_id:
        answer = {"tool_call_id": turn.tool_call_id, "name": function}
        message["content"] = _dumps({**answer, "content": turn.content})
    return message


def generic_instructions(plan: ToolPlan) -> str:
    """The system message that describes the tools to a model whose template does not."""
    lines = [
        "You can call the following tools (functions). Each is described by a JSON object: its name, "
        "what it does and the JSON schema of its arguments.",
        "",
    ]
    for tool in plan.tools:
        described: dict[str, Any] = {"name": tool.name}
        if tool.description:
            described["description"] = tool.description
        described["parameters"] = plan.schemas[tool.name]
        lines.append(_dumps(described))
    form = (
        'To call a tool, answer with only a JSON object {"name": <the tool\'s name>, "arguments": '
        "<an object of its arguments>}"
    )
    if plan.parallel and plan.choice.mode != "function":
        form += ", or with a JSON list of such objects to call several tools at once"
    if plan.choice.mode == "auto":
        form += ". If no tool is needed, answer in plain text instead."
    elif plan.choice.mode == "required":
        form += ". You must call a tool now."
    else:
        form += f'. You must call the tool "{plan.choice.function}" now.'
    lines += ["", form, "The result of each call comes back to you in a tool message."]
    return "\n".join(lines)


def constraint(plan: ToolPlan) -> StructuredOutput | None:
    """The grammar a ``required`` or named-function reply must follow (None: the reply is free)."""
    mode = plan.choice.mode
    if mode not in ("required", "function"):
        return None
    names = [plan.choice.function] if mode == "function" else [t.name for t in plan.tools]
    key = "parameters" if plan.format == "llama3_json" else "arguments"
    calls = [_call_schema(n, key, plan.schemas[n]) for n in names]
    body: dict[str, Any] = dict(calls[0]) if len(calls) == 1 else {"anyOf": calls}
    body["x-guidance"] = JSON_STYLE
    many = plan.parallel and mode == "required"
    if plan.format == "hermes":
        opening, closing = json.dumps("<tool_call>\n"), json.dumps("\n</tool_call>")
        start = 'call ("\\n" call)*' if many else "call"
        rules = [f"start: {start}", f"call: {opening} body {closing}"]
    elif plan.format == "generic" and many:
        rules = ['start: body | "[" body (", " body)* "]"']
    else:
        rules = ["start: body"]
    rules.append(f"body: %json {json.dumps(body)}")
    return StructuredOutput("grammar", "\n".join(rules) + "\n")


def _call_schema(name: str, key: str, parameters: Mapping[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "properties": {"name": {"const": name}, key: parameters},
        "required": ["name", key],
        "additionalProperties": False,
    }


def _dumps(value: Any) -> str:
    return json.dumps(value, ensure_ascii=False)
