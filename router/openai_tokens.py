"""``/tokenize``, ``/detokenize`` and ``/version`` at the HTTP root, in vLLM's shapes: what a client needs
to count a prompt's tokens, find a token's id (for ``logit_bias``, ``stop_token_ids``) or read ids back.

    POST /tokenize    {"prompt": str} or {"messages": [...]}
                      ->  {"count", "max_model_len", "tokens"[, "token_strs"]}
    POST /detokenize  {"tokens": [int]}  ->  {"prompt": str}
    GET  /version     ->  {"version": str}
"""

from __future__ import annotations

from importlib import metadata
from typing import Any

from router.admission import Admission, ChatPrompt
from router.openai_errors import ApiError
from router.openai_requests import FIELDS, chat_turns, check_model
from router.openai_schema import DetokenizeRequest, TokenizeRequest
from router.openai_tools import tool_specs
from router.tokenizer import RouterModel
from serving.errors import ServingError


def tokenize(body: TokenizeRequest, model: RouterModel, admission: Admission) -> dict[str, Any]:
    """``admission`` renders messages as a chat request would (its tools, calls and results too)."""
    if body.model is not None:
        check_model(model, body.model)
    tokenizer = model.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise ApiError.invalid("prompt", "send exactly one of prompt and messages")
    if body.messages is not None:
        prompt = ChatPrompt(chat_turns(body.messages), tools=tool_specs(body.tools))
        try:
            tokens = admission.chat_tokens(prompt, FIELDS, add_generation_prompt=body.add_generation_prompt)
        except ServingError as exc:
            raise ApiError.from_serving(exc) from None
    else:
        if body.tools is not None:
            raise ApiError.invalid("tools", "a text prompt is not rendered with tools; send messages")
        assert body.prompt is not None
        try:
            admission.not_hopeless(len(body.prompt), "prompt")  # the tokenizer holds the GIL
        except ServingError as exc:
            raise ApiError.from_serving(exc) from None
        tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    out: dict[str, Any] = {"count": len(tokens), "max_model_len": admission.context_length, "tokens": tokens}
    if body.return_token_strs:
        out["token_strs"] = [tokenizer.decode([t], skip_special_tokens=False) for t in tokens]
    return out


def detokenize(body: DetokenizeRequest, model: RouterModel) -> dict[str, Any]:
    if body.model is not None:
        check_model(model, body.model)
    for i, t in enumerate(body.tokens):
        if not 0 <= t < model.vocab_size:
            raise ApiError.invalid(
                f"tokens.{i}", f"token id {t} is outside the vocabulary [0, {model.vocab_size})"
            )
    return {"prompt": model.tokenizer.decode(body.tokens, skip_special_tokens=False)}


def version() -> dict[str, Any]:
    try:
        return {"version": metadata.version("pdkv")}
    except metadata.PackageNotFoundError:  # run from a source tree that was never installed
        return {"version": "0+unknown"}
