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

from engine.chat_template import ChatTemplateError
from router.openai_errors import ApiError
from router.openai_requests import check_model, message_text
from router.openai_schema import DetokenizeRequest, TokenizeRequest
from router.tokenizer import RouterModel


def tokenize(body: TokenizeRequest, model: RouterModel) -> dict[str, Any]:
    if body.model is not None:
        check_model(model, body.model)
    tokenizer = model.tokenizer
    if (body.prompt is None) == (body.messages is None):
        raise ApiError.invalid("prompt", "send exactly one of prompt and messages")
    if body.messages is not None:
        conversation = [
            {"role": m.role, "content": message_text(m.content, i)} for i, m in enumerate(body.messages)
        ]
        try:
            tokens = tokenizer.apply_chat_template(
                conversation, add_generation_prompt=body.add_generation_prompt
            )
        except ChatTemplateError as exc:
            raise ApiError.invalid("messages", str(exc)) from None
    else:
        assert body.prompt is not None
        tokens = tokenizer.encode(body.prompt, add_special_tokens=body.add_special_tokens)
    out: dict[str, Any] = {"count": len(tokens), "max_model_len": model.context_length, "tokens": tokens}
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
