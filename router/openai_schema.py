"""The request bodies of the OpenAI-compatible API, as pydantic models (what the official SDK sends).

Every field a client may send is one of three kinds, and only three (``tests/router/test_api_contract.py``
walks the ``openai`` SDK's own request types and fails on a field that is none of them):

- **served**: a field of these models that is neither of the two below;
- **output-neutral** (``OUTPUT_NEUTRAL``): it cannot change the output (who asks, what to store, routing
  and caching hints): accepted and ignored;
- **not served** (``NOT_SERVED``): refused with 400 naming the field whenever it asks for anything but
  its "off" value -- never accepted and dropped.

A field that is in none of them (a newer SDK's, another server's extension such as
``repetition_penalty``) is refused the same way: an unknown field could change the output.
``cache_salt`` is vLLM's extension: requests with the same salt share cached KV, and only they do.
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator
from pydantic_core import PydanticCustomError

from engine.hashing import MAX_CACHE_SALT_LEN
from engine.sampling_params import SamplingParams
from engine.structured import StructuredOutput

# A body field named as a SamplingParams field is that field: a new sampling field is one line below.
_SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams))


# Accepted and ignored: fields that cannot change what is generated.
OUTPUT_NEUTRAL = frozenset(
    {
        "user",
        "metadata",
        "store",
        "service_tier",
        "safety_identifier",
        "prompt_cache_key",
        "prompt_cache_retention",
        "prompt_cache_options",
    }
)


@dataclass(frozen=True)
class NotServed:
    """A field pdkv does not serve: the values that mean "off" (accepted), and why anything else is not."""

    off: tuple[object, ...]
    why: str


_NONE = (None,)
# Refused with 400 naming the field unless off.  Serving one moves it out of this table.
NOT_SERVED: dict[str, NotServed] = {
    "best_of": NotServed(
        (None, 1), "best_of is not served (vLLM dropped it too); use n, or several requests"
    ),
    "suffix": NotServed((None, ""), "suffix is not served"),
    "functions": NotServed((None, []), "the deprecated functions are not served; send tools"),
    "function_call": NotServed(
        (None, "none"), "the deprecated function_call is not served; send tool_choice"
    ),
    "audio": NotServed(_NONE, "audio output is not served"),
    "modalities": NotServed((None, ["text"]), "only text output is served"),
    "prediction": NotServed(_NONE, "predicted outputs are not served"),
    "reasoning_effort": NotServed(_NONE, "this model has no reasoning effort to set"),
    "verbosity": NotServed(_NONE, "verbosity is not served"),
    "web_search_options": NotServed(_NONE, "web search is not served"),
    "moderation": NotServed(_NONE, "moderation is not served"),
    # vLLM's old names for structured outputs: refused, naming the new one.
    "guided_json": NotServed(_NONE, "renamed: send structured_outputs: {json: ...} (or response_format)"),
    "guided_regex": NotServed(_NONE, "renamed: send structured_outputs: {regex: ...}"),
    "guided_choice": NotServed(_NONE, "renamed: send structured_outputs: {choice: [...]}"),
    "guided_grammar": NotServed(_NONE, "renamed: send structured_outputs: {grammar: ...}"),
    "guided_decoding_backend": NotServed(_NONE, "renamed and not needed: pdkv uses llguidance"),
}


class RequestBody(BaseModel):
    # Unknown fields are refused, naming them (see the module docstring): never accepted and ignored.
    # Strict types, as OpenAI's: "5" is not a number, true is not 1, "yes" is not a flag (an integer is
    # still a float).
    model_config = ConfigDict(extra="forbid", strict=True)

    @model_validator(mode="before")
    @classmethod
    def _null_is_unset(cls, data: Any) -> Any:
        """null for a field is that field unset, as OpenAI reads it (the SDK's types allow None for
        ``n``, ``stream``, ``logprobs``, ``echo`` ...): its default applies."""
        if isinstance(data, dict):
            return {k: v for k, v in data.items() if v is not None or k not in cls.model_fields}
        return data


class WholeBody(RequestBody):
    """A request's whole body (not a part nested in one): its every string is checked once, here."""

    @model_validator(mode="before")
    @classmethod
    def _text_has_utf8(cls, data: Any) -> Any:
        """No string anywhere in the body holds a lone UTF-16 surrogate (JSON's "\\ud800" escape decodes to
        one): such text has no UTF-8 form, so no tokenizer, node message or log line could carry it --
        refused naming the field, found from the body down."""
        where = _unencodable(data) if isinstance(data, dict) else None
        if where is not None:
            raise PydanticCustomError(
                "unencodable_text",
                "is not valid text: a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape)",
                {"path": ".".join(map(str, where))},
            )
        return data


def _unencodable(value: Any) -> tuple[Any, ...] | None:
    """Where in a JSON value (keys, then indices) the first string without a UTF-8 form is; None: none."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return ()
        return None
    items = value.items() if isinstance(value, dict) else enumerate(value) if isinstance(value, list) else ()
    for key, item in items:
        if isinstance(key, str) and _unencodable(key) is not None:
            return (key.encode("utf-8", "backslashreplace").decode(),)
        if item.__class__ in _SCALARS:  # a prompt's 100k token ids: no call each
            continue
        inner = _unencodable(item)
        if inner is not None:
            return (key, *inner)
    return None


_SCALARS = frozenset({int, float, bool, type(None)})


class StreamOptions(RequestBody):
    include_usage: bool = False
    # OpenAI pads each chunk with random "obfuscation" text against length side channels: not served --
    # false (or unset) is what pdkv does, true is refused (openai_requests._refuse_unserved).
    include_obfuscation: bool = False


class _Sampling(WholeBody):
    model: str
    max_tokens: int | None = Field(default=None, ge=0)  # 0: completions with echo only (admission)
    temperature: float | None = Field(default=None, ge=0.0, le=2.0)
    top_p: float | None = Field(default=None, ge=0.0, le=1.0)
    seed: int | None = Field(default=None, ge=0, lt=2**63)
    stop: str | list[str] | None = None
    n: int = Field(default=1, ge=1)  # choices; the router's max_n caps it (400 naming n above it)
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    # token id (as a string, as OpenAI's JSON has it) -> bias in [-100, 100]
    logit_bias: dict[str, float] | None = None
    # Output-neutral (OUTPUT_NEUTRAL): accepted and ignored.
    user: str | None = None
    metadata: dict[str, Any] | None = None
    store: bool | None = None
    service_tier: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    prompt_cache_retention: str | None = None
    prompt_cache_options: dict[str, Any] | None = None
    cache_salt: str | None = Field(default=None, min_length=1, max_length=MAX_CACHE_SALT_LEN)
    # pdkv extensions (vLLM's names): top_k, min_p, ignore_eos, stop_token_ids, repetition_penalty,
    # min_tokens.
    repetition_penalty: float | None = None
    min_tokens: int | None = None
    # vLLM's structured outputs: exactly one of json (a schema), regex, choice (strings), grammar (Lark).
    structured_outputs: dict[str, Any] | None = None
    guided_json: Any = None
    guided_regex: Any = None
    guided_choice: Any = None
    guided_grammar: Any = None
    guided_decoding_backend: Any = None
    top_k: int = Field(default=0, ge=0)
    min_p: float = Field(default=0.0, ge=0.0, le=1.0)
    ignore_eos: bool = False
    stop_token_ids: list[int] = Field(default_factory=list)

    def sampling(self) -> dict[str, Any]:
        """The SamplingParams fields this body sets, by their names (null is unset).  OpenAI's own
        defaults and shapes apply: temperature 1, ``stop`` a string or a list, ``logprobs`` a flag (chat)
        or a count (completions, where 0 asks for the chosen token's logprob)."""
        fields = type(self).model_fields
        options = {
            name: getattr(self, name)
            for name in _SAMPLING_FIELDS
            if name in fields and getattr(self, name) is not None
        }
        options.setdefault("temperature", 1.0)
        if isinstance(self.stop, str):
            options["stop"] = (self.stop,)
        if "logprobs" in options:  # chat: a flag; completions: how many alternatives (0: the chosen only)
            asked = options["logprobs"]
            options["logprobs"] = asked is not False
            if not isinstance(asked, bool) and isinstance(asked, int):
                options["top_logprobs"] = asked
        if self.logit_bias is not None:
            options["logit_bias"] = _token_bias(self.logit_bias)
        return options


class FunctionDefinition(RequestBody):
    name: str
    description: str | None = None
    # The JSON schema of the arguments; unset: the function takes none.
    parameters: dict[str, Any] | None = None
    # Accepted: under tool_choice required or a named function the arguments are always constrained to
    # the schema; under auto they are parsed, not constrained (docs/tool_calls.md).
    strict: bool | None = None


class ToolDefinition(RequestBody):
    type: Literal["function"]
    function: FunctionDefinition


class FunctionCall(RequestBody):
    name: str
    arguments: str  # a JSON object, as text


class ToolCallItem(RequestBody):
    id: str
    type: Literal["function"]
    function: FunctionCall


class ChatMessage(RequestBody):
    role: Literal["system", "user", "assistant", "tool", "developer"]
    # A string, or a list of text parts ({"type": "text", "text": ...}) as newer SDKs send.
    content: str | list[dict[str, Any]] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # an assistant's calls
    tool_call_id: str | None = None  # a tool message: the call it answers
    # What a reply's message carries besides (a client that sends back ``message.model_dump()``): accepted
    # at their "off" values only (router/openai_requests.py); ``annotations`` (citations) never reach
    # the model, as on OpenAI.
    refusal: str | None = None
    audio: Any = None
    function_call: Any = None
    annotations: list[Any] | None = None


class ChatCompletionRequest(_Sampling):
    messages: list[ChatMessage] = Field(min_length=1)
    # OpenAI's structured outputs: {"type": "text" | "json_object" | "json_schema", "json_schema": {...}}
    response_format: dict[str, Any] | None = None
    max_completion_tokens: int | None = Field(default=None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(default=None, ge=0, le=20)
    tools: list[ToolDefinition] | None = None
    # "none", "auto", "required" or {"type": "function", "function": {"name": ...}} (router/openai_tools.py)
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    # Not served (NOT_SERVED): refused unless off.
    functions: list[dict[str, Any]] | None = None
    function_call: Any = None
    audio: Any = None
    modalities: list[str] | None = None
    prediction: Any = None
    reasoning_effort: str | None = None
    verbosity: str | None = None
    web_search_options: Any = None
    moderation: Any = None


class CompletionRequest(_Sampling):
    # A string, a list of one string, token ids, or a list of one list of token ids.
    prompt: str | list[str] | list[int] | list[list[int]]
    logprobs: int | None = Field(default=None, ge=0, le=5)
    echo: bool = False
    suffix: str | None = None
    best_of: int | None = None


def _token_bias(bias: dict[str, float]) -> dict[int, float]:
    """OpenAI's ``logit_bias`` (token ids as JSON object keys) keyed by token id."""
    out: dict[int, float] = {}
    for key, value in bias.items():
        if not key.strip().isdigit():
            raise ValueError(f"logit_bias keys must be token ids (non-negative integers), got {key!r}")
        out[int(key)] = value
    return out


_STRUCTURED_KEYS = {"json": "json_schema", "regex": "regex", "choice": "choice", "grammar": "grammar"}


def structured_output(body: BaseModel) -> tuple[StructuredOutput | None, str]:
    """The constraint a body asks for, and the field that names it in an error; ``ValueError`` (the
    message starting with that field) when the field is malformed."""
    response_format = getattr(body, "response_format", None)
    asked: dict[str, Any] | None = getattr(body, "structured_outputs", None)
    if response_format is not None and asked is not None:
        raise ValueError("structured_outputs: send one of response_format and structured_outputs")
    if response_format is not None:
        return _response_format(response_format), "response_format"
    if asked is None:
        return None, ""
    keys = [k for k, v in asked.items() if v is not None]
    unknown = [k for k in keys if k not in _STRUCTURED_KEYS]
    if unknown:
        raise ValueError(f"structured_outputs.{unknown[0]}: is not served (json, regex, choice, grammar are)")
    if len(keys) != 1:
        raise ValueError("structured_outputs: set exactly one of json, regex, choice, grammar")
    key = keys[0]
    value, where = asked[key], f"structured_outputs.{key}"
    try:
        if key == "json":
            if isinstance(value, str):
                value = json.loads(value)
            if not isinstance(value, dict):
                raise ValueError("must be a JSON schema (an object)")
            return StructuredOutput.json_schema(value), where
        if key == "choice":
            if not isinstance(value, list):
                raise ValueError("must be a list of strings")
            return StructuredOutput.choice(value), where
        if not isinstance(value, str):
            raise ValueError("must be a string")
        return StructuredOutput(_STRUCTURED_KEYS[key], value), where  # type: ignore[arg-type]
    except ValueError as exc:
        raise ValueError(f"{where}: {str(exc).removeprefix('structured.')}") from None


# Per response_format type, the keys it takes (another key is refused by name: never dropped); and
# json_schema's own (``strict`` accepted: the reply is always held to the schema).
_FORMAT_KEYS = {"text": {"type"}, "json_object": {"type"}, "json_schema": {"type", "json_schema"}}
_JSON_SCHEMA_KEYS = {"name", "description", "schema", "strict"}
_SCHEMA_NAME = re.compile(r"[A-Za-z0-9_-]{1,64}")


def _response_format(value: dict[str, Any]) -> StructuredOutput | None:
    kind = value.get("type")
    if kind not in _FORMAT_KEYS:
        raise ValueError(f"response_format.type: {kind!r} is not one of text, json_object, json_schema")
    extra = sorted(set(value) - _FORMAT_KEYS[kind])
    if extra:
        raise ValueError(f"response_format.{extra[0]}: is not a key of a {kind!r} response_format")
    if kind == "text":
        return None
    if kind == "json_object":
        return StructuredOutput("json_object")
    spec = value.get("json_schema")
    extra = sorted(set(spec) - _JSON_SCHEMA_KEYS) if isinstance(spec, dict) else []
    if extra:
        raise ValueError(f"response_format.json_schema.{extra[0]}: is not a key of a json_schema")
    name = spec.get("name") if isinstance(spec, dict) else None
    if not isinstance(name, str) or not _SCHEMA_NAME.fullmatch(name):
        # OpenAI's rule (required, its pattern): a request OpenAI refuses is not served here either
        raise ValueError(
            f"response_format.json_schema.name: is required, 1-64 letters, digits, _ or -; got {name!r}"
        )
    schema = spec.get("schema") if isinstance(spec, dict) else None
    if not isinstance(schema, dict):
        raise ValueError("response_format.json_schema.schema: must be a JSON schema (an object)")
    return StructuredOutput.json_schema(schema)


def unserved_field(body: BaseModel) -> tuple[str, str] | None:
    """The first field of ``body`` that asks for something pdkv does not serve, with why (None: none)."""
    for name, rule in NOT_SERVED.items():
        if name in type(body).model_fields and getattr(body, name) not in rule.off:
            return name, rule.why
    return None


class TokenizeRequest(WholeBody):
    """``POST /tokenize`` (vLLM's shape): a text prompt, or messages rendered with the chat template."""

    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    tools: list[ToolDefinition] | None = None  # rendered as a request with tool_choice auto would be
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    return_token_strs: bool = False


class DetokenizeRequest(WholeBody):
    """``POST /detokenize`` (vLLM's shape): token ids back to text."""

    model: str | None = None
    tokens: list[int]
