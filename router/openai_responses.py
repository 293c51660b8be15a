"""The OpenAI-compatible API's response objects, and the non-streaming answer.

``ResponseShape`` builds one request's objects from the pipeline's events: ``chat.completion`` /
``text_completion`` whole, their chunks for a stream (``router/openai_stream.py`` sends them), the
logprobs and usage as OpenAI spells them.  ``whole_response`` collects a request's events into one JSON
answer, ending the call's scope if the client disconnects meanwhile.  ``model_card`` is ``GET /v1/models``'s
object.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncGenerator
from typing import Any

from fastapi.responses import JSONResponse

from engine.sampling_params import TopLogprobs
from router.admission import AdmittedRequest, GenerationRequest, TextPrompt
from router.events import Delta, Done, Event, Usage, total_usage
from router.http_scope import HttpCallScope, watch_disconnect
from router.openai_errors import ApiError
from router.tokenizer import RouterModel
from serving.errors import ServingError


class ResponseShape:
    """Builds one request's response objects (chat.completion / text_completion, whole or chunked)."""

    def __init__(
        self,
        model: RouterModel,
        request_id: str,
        *,
        created: int,
        chat: bool,
        logprobs: bool,
        cache_details: bool = False,
        n: int = 1,
        echo: Echo | None = None,
    ) -> None:
        """``n``: the request's choices (a stream's usage chunk waits for the last one's end); ``echo``:
        the prompt every completion choice starts with (completions' ``echo``)."""
        self.model, self.id, self.created, self.chat, self.logprobs = (
            model,
            request_id,
            created,
            chat,
            logprobs,
        )
        self.cache_details = cache_details
        self.n = n
        self.echo = echo
        self._echoed: set[int] = set()  # the choices whose stream has had the prompt

    def envelope(self) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model.name}

    def chunk(
        self, delta: Any, finish_reason: str | None, logprobs: Any = None, index: int = 0
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason, "logprobs": logprobs}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        return {**self.envelope(), "choices": [choice]}

    def delta_chunk(self, d: Delta) -> dict[str, Any]:
        ids, text = d.token_ids, d.text
        lps: list[float | None] = list(d.logprobs)
        tops: list[TopLogprobs | None] = list(d.top_logprobs)
        if self.echo is not None and d.index not in self._echoed:  # a choice's first chunk: the prompt first
            self._echoed.add(d.index)
            self.echo.seen(d)
            ids, text = [*self.echo.token_ids, *ids], self.echo.text + text
            lps, tops = [*self.echo.logprobs(), *lps], [*self.echo.top_logprobs(), *tops]
        lp = self._logprobs(ids, lps, tops) if self.logprobs else None
        return self.chunk({"content": text} if self.chat else text, None, lp, d.index)

    def whole(self, choices: list[tuple[list[Delta], Done]]) -> dict[str, Any]:
        """The whole answer: one choice per (deltas, done) of a choice, in index order."""
        if self.echo is not None:
            for deltas, _ in choices:
                for d in deltas:
                    self.echo.seen(d)
        return {
            "id": self.id,
            "object": "chat.completion" if self.chat else "text_completion",
            "created": self.created,
            "model": self.model.name,
            "choices": [self._choice(deltas, done) for deltas, done in choices],
            "usage": self.usage(total_usage([done.usage for _, done in choices])),
        }

    def _choice(self, deltas: list[Delta], done: Done) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        ids = [t for d in deltas for t in d.token_ids]
        lps: list[float | None] = [x for d in deltas for x in d.logprobs]
        tops: list[TopLogprobs | None] = [x for d in deltas for x in d.top_logprobs]
        if self.echo is not None:
            ids, text = [*self.echo.token_ids, *ids], self.echo.text + text
            lps, tops = [*self.echo.logprobs(), *lps], [*self.echo.top_logprobs(), *tops]
        choice: dict[str, Any] = {
            "index": done.index,
            "finish_reason": done.finish_reason,
            "logprobs": self._logprobs(ids, lps, tops) if self.logprobs else None,
        }
        if self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return choice

    def _logprobs(self, ids: list[int], lps: list[float | None], tops: list[TopLogprobs | None]) -> Any:
        """OpenAI's logprobs object: chat's ``content`` entries (each with its ``top_logprobs``), or
        completions' parallel lists (``top_logprobs``: one {token: logprob} map per token; None where a
        position has none: an echoed prompt's first token)."""
        tokens = [self._token(t) for t in ids]
        if self.chat:
            return {
                "content": [
                    {
                        "token": s,
                        "logprob": lp,
                        "bytes": list(s.encode("utf-8")),
                        "top_logprobs": [
                            {
                                "token": self._token(t),
                                "logprob": v,
                                "bytes": list(self._token(t).encode("utf-8")),
                            }
                            for t, v in ((tops[i] or ()) if i < len(tops) else ())
                        ],
                    }
                    for i, (s, lp) in enumerate(zip(tokens, lps, strict=False))
                ]
            }
        offsets, at = [], 0
        for s in tokens:
            offsets.append(at)
            at += len(s)
        top_maps = (
            [None if top is None else {self._token(t): v for t, v in top} for top in tops]
            if any(tops)
            else None
        )
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": top_maps, "text_offset": offsets}

    def _token(self, token_id: int) -> str:
        return self.model.tokenizer.decode([token_id], skip_special_tokens=False)

    def usage(self, u: Usage) -> dict[str, Any]:
        """OpenAI's usage; cached-token counts only where the operator enabled them."""
        out: dict[str, Any] = {
            "prompt_tokens": u.prompt_tokens,
            "completion_tokens": u.completion_tokens,
            "total_tokens": u.prompt_tokens + u.completion_tokens,
            "pdkv": {"time_to_first_token_s": round(u.time_to_first_token_s, 6)},
        }
        if self.cache_details:
            out["prompt_tokens_details"] = {"cached_tokens": u.local_prefix + u.store}
            out["pdkv"]["cached_tokens_by_source"] = {
                "local_prefix": u.local_prefix,
                "store": u.store,
                "remote_prefill": u.remote_prefill,
            }
            out["pdkv"]["computed_prompt_tokens"] = u.computed_prompt_tokens
        return out


async def whole_response(
    events: AsyncGenerator[Event, None], http: Any, scope: HttpCallScope, shape: ResponseShape
) -> JSONResponse:
    """The request's events as one JSON answer; a client that disconnects first ends ``scope`` (the
    request is aborted downstream), and a refusal or failure is raised as its ``ApiError``."""
    watcher = asyncio.create_task(watch_disconnect(http, scope))
    try:
        deltas: list[list[Delta]] = [[] for _ in range(shape.n)]
        done: list[Done | None] = [None] * shape.n
        try:
            async for event in events:
                if isinstance(event, Delta):
                    deltas[event.index].append(event)
                else:
                    done[event.index] = event
        except ServingError as exc:
            raise ApiError.from_serving(exc) from None
        ended = [d for d in done if d is not None]
        assert len(ended) == shape.n, "the pipeline ended without every choice's Done"
        return JSONResponse(shape.whole(list(zip(deltas, ended, strict=True))))
    finally:
        watcher.cancel()


class Echo:
    """Completions' ``echo``: the prompt (its text as the client sent it, or its tokens' text) before each
    choice's completion, with the prompt's scores when the request asked for logprobs (they arrive with the
    first choice's first delta: ``seen``).  The first token has no logprob (None), as OpenAI answers."""

    def __init__(self, text: str, token_ids: list[int]) -> None:
        self.text, self.token_ids = text, token_ids
        self._logprobs: list[float] | None = None
        self._tops: list[TopLogprobs] = []

    def seen(self, d: Delta) -> None:
        if d.prompt_logprobs is not None and self._logprobs is None:
            self._logprobs, self._tops = d.prompt_logprobs, d.prompt_top_logprobs

    def logprobs(self) -> list[float | None]:
        rest = self._logprobs if self._logprobs is not None else [None] * (len(self.token_ids) - 1)
        return [None, *rest]

    def top_logprobs(self) -> list[TopLogprobs | None]:
        if not self._tops:
            return [None] * len(self.token_ids)
        return [None, *self._tops]


def model_card(model: RouterModel, created: int) -> dict[str, Any]:
    return {
        "id": model.name,
        "object": "model",
        "created": created,
        "owned_by": "pdkv",
        "max_model_len": model.context_length,
        "context_length": model.context_length,
    }


def echo_of(asked: GenerationRequest, request: AdmittedRequest, model: RouterModel) -> Echo:
    """What ``echo`` repeats of this request: the client's text prompt as sent, or its tokens' text."""
    ids = list(request.prompt_token_ids)
    prompt = asked.prompt
    text = (
        prompt.text
        if isinstance(prompt, TextPrompt)
        else model.tokenizer.decode(ids, skip_special_tokens=False)
    )
    return Echo(text, ids)
