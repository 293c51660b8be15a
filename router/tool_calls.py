"""Tool calls, the request side: the functions a client offers (``ToolSpec``), what it lets the model do
with them (``ToolChoice``), the calls in a conversation's history (``ToolCall``), and the checks both
front ends share -- admission runs them (``check_tools``, ``check_choice``, ``check_history``) and each
refusal names the field as the client spells it (``ToolFields``).

How a model calls a tool is its chat template's business; pdkv reads the template's source once to know
which syntax to ask for and to parse (``tool_format``):

    hermes        the template renders <tool_call>{"name": ..., "arguments": {...}}</tool_call>
                  (Qwen2.5, Hermes, the ChatML tool models)
    llama3_json   the template asks for {"name": ..., "parameters": {...}} (Llama 3.1 to 3.3)
    generic       the template does not render tools (SmolLM2's does not) or renders them in a syntax
                  pdkv does not parse: pdkv describes the tools in a system message and asks for
                  {"name": ..., "arguments": {...}} (or a list of them), as llama.cpp's generic format does
"""

from __future__ import annotations

import json
import re
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, Literal, Protocol

ToolFormat = Literal["hermes", "llama3_json", "generic"]
ChoiceMode = Literal["none", "auto", "required", "function"]
# OpenAI's limits: 128 tools, names of letters, digits, underscores and dashes, at most 64 characters.
MAX_TOOLS = 128
NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")
# A function without parameters takes none (OpenAI's reading of an omitted ``parameters``).
NO_PARAMETERS: dict[str, Any] = {"type": "object", "properties": {}, "additionalProperties": False}


class ToolFieldError(ValueError):
    """A refused tool field: ``field`` as the client spells it (admission turns it into InvalidField)."""

    def __init__(self, field: str, problem: str) -> None:
        super().__init__(f"{field}: {problem}")
        self.field, self.problem = field, problem


@dataclass(frozen=True)
class ToolSpec:
    """One function the model may call.  ``parameters``: the JSON schema of its arguments as JSON text
    (empty: no parameters)."""

    name: str
    description: str = ""
    parameters: str = ""
    strict: bool = False


@dataclass(frozen=True)
class ToolChoice:
    """``none`` (never call), ``auto`` (the model decides), ``required`` (at least one call) or
    ``function`` (exactly one call, of ``function``)."""

    mode: ChoiceMode
    function: str = ""


@dataclass(frozen=True)
class ToolCall:
    """One call, in a conversation's history or in a reply.  ``arguments``: a JSON object, as text."""

    id: str
    name: str
    arguments: str


@dataclass(frozen=True)
class ToolFields:
    """How a front end names the tool fields in its errors ("{i}": a tool or a message, "{j}": a call)."""

    tools: str = "tools"
    tool: str = "tools.{i}.function"  # one tool's function: its name and parameters
    tool_choice: str = "tool_choice"
    message: str = "messages.{i}"  # one message: its tool_call_id, tool_calls
    tool_call: str = "messages.{i}.tool_calls.{j}"  # one call of an assistant message: its id
    tool_call_function: str = "messages.{i}.tool_calls.{j}.function"  # its name and arguments


@dataclass(frozen=True)
class ToolPlan:
    """A request's tools, checked: what the template, the constraint and the reply's parser need."""

    format: ToolFormat
    tools: tuple[ToolSpec, ...]
    schemas: Mapping[str, Mapping[str, Any]]  # tool name -> the JSON schema of its arguments
    choice: ToolChoice
    parallel: bool  # more than one call per reply allowed

    @property
    def calls_allowed(self) -> bool:
        return self.choice.mode != "none"


def tool_format(template_source: str | None) -> ToolFormat | None:
    """The syntax the template's model calls tools in (None: no chat template, so no tools)."""
    if template_source is None:
        return None
    if "<tool_call>" in template_source:
        return "hermes"
    if (
        re.search(r"\btools\b", template_source)
        and '"parameters"' in template_source
        and ("ipython" in template_source or "<|python_tag|>" in template_source)
    ):
        return "llama3_json"
    return "generic"


def check_tools(
    tools: Sequence[ToolSpec], fields: ToolFields, check_schema: Callable[[Mapping[str, Any]], None]
) -> dict[str, Mapping[str, Any]]:
    """Each tool's arguments schema by its name; ``check_schema`` raises ValueError on a schema the
    structured-output engine cannot enforce (it is the one that enforces it under ``required``)."""
    if len(tools) > MAX_TOOLS:
        raise ToolFieldError(fields.tools, f"at most {MAX_TOOLS} tools per request ({len(tools)} sent)")
    schemas: dict[str, Mapping[str, Any]] = {}
    for i, tool in enumerate(tools):
        where = fields.tool.format(i=i)
        if not NAME.fullmatch(tool.name):
            raise ToolFieldError(
                f"{where}.name",
                f"{tool.name!r} is not a function name: 1 to 64 letters, digits, underscores or dashes",
            )
        if tool.name in schemas:
            raise ToolFieldError(f"{where}.name", f"{tool.name!r} names an earlier tool too")
        schemas[tool.name] = _schema(tool.parameters, f"{where}.parameters", check_schema)
    return schemas


def _schema(text: str, where: str, check: Callable[[Mapping[str, Any]], None]) -> Mapping[str, Any]:
    if not text:
        return NO_PARAMETERS
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ToolFieldError(where, f"is not JSON: {exc}") from None
    if not isinstance(schema, dict):
        raise ToolFieldError(where, f"must be a JSON schema (an object), got {type(schema).__name__}")
    kind = schema.get("type")
    if kind is None or (isinstance(kind, list) and "object" in kind):
        schema = {**schema, "type": "object"}  # `{}` and the like: the arguments are an object all the same
    elif kind != "object":
        raise ToolFieldError(
            where,
            f'must describe an object ("type": "object"), not {json.dumps(kind)}: a call\'s arguments are a '
            "JSON object",
        )
    try:
        check(schema)
    except ValueError as exc:
        raise ToolFieldError(where, f"is not a JSON schema pdkv can enforce: {exc}") from None
    return schema


def check_choice(choice: ToolChoice | None, names: Sequence[str], fields: ToolFields) -> ToolChoice:
    """The choice as it applies: unset is ``auto`` with tools and ``none`` without (OpenAI's defaults);
    ``required`` or a function needs tools, and a function must be one of them."""
    if choice is None:
        return ToolChoice("auto" if names else "none")
    if choice.mode in ("required", "function") and not names:
        raise ToolFieldError(fields.tool_choice, f"{_choice_text(choice)} needs tools to call; send tools")
    if choice.mode == "function" and choice.function not in names:
        raise ToolFieldError(
            fields.tool_choice,
            f"names the function {choice.function!r}, which is not one of the tools ({', '.join(names)})",
        )
    return choice


def _choice_text(choice: ToolChoice) -> str:
    return f"the function {choice.function!r}" if choice.mode == "function" else repr(choice.mode)


class HistoryTurn(Protocol):
    """What ``check_history`` reads of a message (``router.admission.ChatTurn`` has it)."""

    @property
    def role(self) -> str: ...
    @property
    def tool_calls(self) -> tuple[ToolCall, ...]: ...
    @property
    def tool_call_id(self) -> str | None: ...
    @property
    def name(self) -> str | None: ...


def check_history(turns: Sequence[HistoryTurn], fields: ToolFields) -> dict[int, str]:
    """The conversation's calls and results, checked as OpenAI checks them: only an assistant calls, each
    call has an id, a name and arguments that are a JSON object, no two calls of one message share an id;
    a tool message answers an earlier call by its ``tool_call_id`` (the nearest one with that id: a
    client may number each turn's calls from call_0 again), and a ``name`` it carries (the legacy
    function-result shape) is that call's function.  Returns each tool message's index with the function
    it answers (a tool result is rendered with it)."""
    called: dict[str, str] = {}  # each call id's function, the latest call with the id
    answers: dict[int, str] = {}
    for i, turn in enumerate(turns):
        where = fields.message.format(i=i)
        if turn.tool_calls and turn.role != "assistant":
            raise ToolFieldError(
                f"{where}.tool_calls", f"only an assistant message calls tools, not {turn.role}"
            )
        in_message: dict[str, int] = {}
        for j, call in enumerate(turn.tool_calls):
            at = fields.tool_call.format(i=i, j=j)
            _check_call(call, at, fields.tool_call_function.format(i=i, j=j))
            if call.id in in_message:  # a tool message answering the id could mean either call
                raise ToolFieldError(
                    f"{at}.id",
                    f"{call.id!r} is also the id of call {in_message[call.id]} of this message: each call "
                    "needs its own",
                )
            in_message[call.id] = j
        called.update((call.id, call.name) for call in turn.tool_calls)
        if turn.role == "tool":
            if not turn.tool_call_id:
                raise ToolFieldError(
                    f"{where}.tool_call_id",
                    "a tool message needs the id of the call it answers (the assistant's tool_calls[].id)",
                )
            if turn.tool_call_id not in called:
                raise ToolFieldError(
                    f"{where}.tool_call_id",
                    f"{turn.tool_call_id!r} answers no call of an earlier assistant message",
                )
            function = called[turn.tool_call_id]
            if turn.name is not None and turn.name != function:
                raise ToolFieldError(
                    f"{where}.name",
                    f"{turn.name!r}, but the call {turn.tool_call_id!r} it answers is {function!r}",
                )
            answers[i] = function
        elif turn.tool_call_id is not None:
            raise ToolFieldError(f"{where}.tool_call_id", f"only a tool message has one, not {turn.role}")
    return answers


def _check_call(call: ToolCall, where: str, function: str) -> None:
    if not call.id:
        raise ToolFieldError(f"{where}.id", "a call needs an id (a tool message answers it by this id)")
    if not call.name:
        raise ToolFieldError(f"{function}.name", "is empty")
    try:
        arguments = json.loads(call.arguments)
    except json.JSONDecodeError as exc:
        raise ToolFieldError(f"{function}.arguments", f"is not JSON: {exc}") from None
    if not isinstance(arguments, dict):
        raise ToolFieldError(f"{function}.arguments", "must be a JSON object (as text)")
