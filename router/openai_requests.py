"""The OpenAI-compatible API's request bodies as the neutral ``GenerationRequest``.

A handler only converts: a chat or completion body (``router/openai_schema.py``) becomes the neutral
request that takes the one admission path the gRPC front end takes too (``router/admission.py``: chat
template, tokens, vocabulary, context, defaults).  What is refused here is what admission cannot see: a
model this router does not serve (404) and the fields of OpenAI's schema pdkv does not serve (400 naming
the field, never accepted and ignored).
"""

from __future__ import annotations

import uuid
from typing import Any

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
from router.openai_schema import ChatCompletionRequest, CompletionRequest
from router.tokenizer import RouterModel

# How this front end names a request's fields in a 400 (its ``param``).
FIELDS = FieldNames(
    text="prompt", messages="messages", token_ids="prompt", token_id="prompt.{i}", sampling=""
)


def check_model(model: RouterModel, name: str) -> None:
    """404 unless ``name`` is the model this router serves."""
    if name != model.name:
        raise ApiError(
            404,
            f"model {name!r} is not served here; this server serves {model.name!r} (GET /v1/models)",
            kind="not_found_error",
            param="model",
            code="model_not_found",
        )


def _refuse_unserved(body: ChatCompletionRequest | CompletionRequest) -> None:
    """Fields of OpenAI's schema pdkv does not serve: refused naming them, never accepted and ignored."""
    if body.n != 1:
        raise ApiError.invalid("n", f"only n=1 is served, got {body.n}; send one request per completion")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) != 0:
            raise ApiError.invalid(name, "penalties are not supported; leave it at 0")


def chat_request(body: ChatCompletionRequest, model: RouterModel) -> GenerationRequest:
    """A chat completion body as the neutral request (admission checks the rest)."""
    check_model(model, body.model)
    _refuse_unserved(body)
    if body.tools:
        raise ApiError.invalid("tools", "tool calls are not supported")
    if body.top_logprobs:
        raise ApiError.invalid("top_logprobs", "only the chosen token's logprob is returned; use 0")
    turns = []
    for i, m in enumerate(body.messages):
        content = m.content
        if isinstance(content, list):  # text parts only
            parts = []
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    raise ApiError.invalid(f"messages.{i}.content.{j}", "only text parts are supported")
                parts.append(part["text"])
            content = "".join(parts)
        turns.append(ChatTurn(m.role, content or ""))
    sampling = body.sampling()
    if body.max_completion_tokens is not None:  # the newer name wins
        sampling["max_tokens"] = body.max_completion_tokens
    return _neutral(body, "chatcmpl", ChatPrompt(tuple(turns)), sampling)


def completion_request(body: CompletionRequest, model: RouterModel) -> GenerationRequest:
    """A completion body as the neutral request (admission checks the rest)."""
    check_model(model, body.model)
    _refuse_unserved(body)
    if body.echo:
        raise ApiError.invalid("echo", "echo is not supported")
    if body.suffix:
        raise ApiError.invalid("suffix", "suffix is not supported")
    if body.logprobs:
        raise ApiError.invalid("logprobs", "only the chosen token's logprob is returned; use 0")
    prompt: Any = body.prompt
    if isinstance(prompt, list) and prompt and isinstance(prompt[0], str | list):
        if len(prompt) != 1:
            raise ApiError.invalid(
                "prompt", f"a list of {len(prompt)} prompts is not served; send one prompt per request"
            )
        prompt = prompt[0]
    neutral = TextPrompt(prompt) if isinstance(prompt, str) else TokenPrompt(tuple(prompt))
    return _neutral(body, "cmpl", neutral, body.sampling())


def _neutral(
    body: ChatCompletionRequest | CompletionRequest, kind: str, prompt: Prompt, sampling: dict[str, Any]
) -> GenerationRequest:
    return GenerationRequest(
        request_id=f"{kind}-{uuid.uuid4().hex}",
        prompt=prompt,
        fields=FIELDS,
        sampling=sampling,
        cache_salt=body.cache_salt,
        stream=body.stream,
        include_usage=bool(body.stream_options and body.stream_options.include_usage),
    )
