"""The OpenAI-compatible API's request bodies as the neutral ``GenerationRequest``.

A handler only converts: a chat or completion body (``router/openai_schema.py``) becomes the neutral
request that takes the one admission path the gRPC front end takes too (``router/admission.py``: chat
template, tokens, vocabulary, context, defaults).  What is refused here is what admission cannot see: a
model this router does not serve (404) and the fields of OpenAI's schema pdkv does not serve (400 naming
the field, never accepted and ignored).
"""

from __future__ import annotations

import dataclasses
import uuid
from typing import Any

from router.adapters import RouterAdapters
from router.admission import (
    ChatPrompt,
    ChatTurn,
    FieldNames,
    GenerationRequest,
    Prompt,
    TextPrompt,
    TokenPrompt,
)
from router.openai_errors import ApiError
from router.openai_schema import (
    ChatCompletionRequest,
    ChatMessage,
    CompletionRequest,
    structured_output,
    unserved_field,
)
from router.openai_tools import message_calls, tool_choice, tool_specs
from router.tokenizer import RouterModel

# How this front end names a request's fields in a 400 (its ``param``).
FIELDS = FieldNames(
    text="prompt", messages="messages", token_ids="prompt", token_id="prompt.{i}", sampling=""
)


def check_model(model: RouterModel, name: str, adapters: RouterAdapters | None = None) -> str | None:
    """The LoRA adapter ``name`` selects (None: the base model, by its name); 404 for any other."""
    if name == model.name:
        return None
    served = adapters.served() if adapters is not None else {}
    if name in served:
        return name
    listed = ", ".join(repr(n) for n in [model.name, *served])
    raise ApiError(
        404,
        f"model {name!r} is not served here; this server serves {listed} (GET /v1/models)",
        kind="not_found_error",
        param="model",
        code="model_not_found",
    )


def _refuse_unserved(body: ChatCompletionRequest | CompletionRequest) -> None:
    """Fields of OpenAI's schema pdkv does not serve (``openai_schema.NOT_SERVED``): refused naming them
    unless off, never accepted and ignored."""
    unserved = unserved_field(body)
    if unserved is not None:
        name, why = unserved
        raise ApiError.invalid(name, f"{why} (got {getattr(body, name)!r})")
    if body.stream_options is not None and not body.stream:  # it would be accepted and do nothing
        raise ApiError.invalid("stream_options", "only allowed with stream: true (as OpenAI requires)")
    if body.stream_options is not None and body.stream_options.include_obfuscation:
        raise ApiError.invalid(
            "stream_options.include_obfuscation",
            "stream obfuscation (random padding on each chunk) is not served: send false or leave it out",
        )


def chat_request(
    body: ChatCompletionRequest, model: RouterModel, adapters: RouterAdapters | None = None
) -> GenerationRequest:
    """A chat completion body as the neutral request (admission checks the rest)."""
    adapter = check_model(model, body.model, adapters)
    _refuse_unserved(body)
    if body.top_logprobs and not body.logprobs:
        raise ApiError.invalid("top_logprobs", "needs logprobs: true (as OpenAI requires)")
    prompt = ChatPrompt(
        chat_turns(body.messages),
        tools=tool_specs(body.tools),
        tool_choice=tool_choice(body.tool_choice),
        parallel_tool_calls=body.parallel_tool_calls is not False,
    )
    return _neutral(body, "chatcmpl", prompt, adapter)


def chat_turns(messages: list[ChatMessage]) -> tuple[ChatTurn, ...]:
    """The body's messages as the neutral conversation (admission checks the calls and results)."""
    for i, m in enumerate(messages):
        for name in ("refusal", "audio", "function_call"):
            if getattr(m, name) is not None:
                raise ApiError.invalid(
                    f"messages.{i}.{name}",
                    "is not served in a message (send it as content, or leave it null)",
                )
        if m.content is None and m.role != "assistant":  # OpenAI's rule: only an assistant's may be null
            raise ApiError.invalid(f"messages.{i}.content", f"is required in a {m.role} message")
    return tuple(
        ChatTurn(m.role, message_text(m.content, i), m.name, message_calls(m), m.tool_call_id)
        for i, m in enumerate(messages)
    )


def completion_request(
    body: CompletionRequest, model: RouterModel, adapters: RouterAdapters | None = None
) -> GenerationRequest:
    """A completion body as the neutral request (admission checks the rest)."""
    adapter = check_model(model, body.model, adapters)
    _refuse_unserved(body)
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise ApiError.invalid(
                "prompt", f"a list of {len(prompt)} prompts is not served; send one prompt per request"
            )
        prompt = prompt[0]
    neutral = TextPrompt(prompt) if isinstance(prompt, str) else TokenPrompt(tuple(prompt))
    request = _neutral(body, "cmpl", neutral, adapter)
    if not body.echo:
        return request
    # echo: the prompt comes back before the completion, scored when logprobs asks for it (the prompt's
    # tokens with their logprobs and that many alternatives, as lm-eval-harness's loglikelihood reads them).
    scoring = body.logprobs if body.logprobs is not None else (0 if body.max_tokens == 0 else None)
    if scoring is None:
        return request
    return dataclasses.replace(request, sampling={**request.sampling, "prompt_logprobs": scoring})


def _sampling(body: ChatCompletionRequest | CompletionRequest) -> tuple[dict[str, Any], FieldNames]:
    """The body's sampling fields by SamplingParams's names, and how this request names its fields."""
    try:
        options = body.sampling()
    except ValueError as exc:  # only logit_bias's keys are read there; the message names the field
        raise ApiError.invalid("logit_bias", str(exc).removeprefix("logit_bias ")) from None
    try:
        structured, where = structured_output(body)
    except ValueError as exc:  # "field: problem"
        field, _, problem = str(exc).partition(": ")
        raise ApiError.invalid(field, problem) from None
    if structured is None:
        return options, FIELDS
    return {**options, "structured": structured}, dataclasses.replace(FIELDS, structured=where)


def _neutral(
    body: ChatCompletionRequest | CompletionRequest, kind: str, prompt: Prompt, adapter: str | None
) -> GenerationRequest:
    sampling, fields = _sampling(body)
    if isinstance(body, ChatCompletionRequest) and body.max_completion_tokens is not None:
        sampling["max_tokens"] = body.max_completion_tokens  # the newer name wins, and errors name it
        fields = dataclasses.replace(fields, max_tokens="max_completion_tokens")
    if sampling.get("max_tokens") == 0 and not getattr(body, "echo", False):
        raise ApiError.invalid(fields.max_tokens, "must be at least 1 (0 only with echo on completions)")
    return GenerationRequest(
        request_id=f"{kind}-{uuid.uuid4().hex}",
        prompt=prompt,
        fields=fields,
        sampling=sampling,
        cache_salt=body.cache_salt,
        stream=body.stream,
        n=body.n,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
        adapter=adapter,
        adapter_field="model",
    )


def message_text(content: str | list[dict[str, Any]] | None, i: int) -> str:
    """Message ``i``'s content as text: a string, or a list of text parts as newer SDKs send."""
    if content is None or isinstance(content, str):
        return content or ""
    parts = []
    for j, part in enumerate(content):
        if part.get("type") != "text" or not isinstance(part.get("text"), str):
            raise ApiError.invalid(f"messages.{i}.content.{j}", "only text parts are supported")
        parts.append(part["text"])
    return "".join(parts)
