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
from router.events import Delta, Done, Event, Usage
from router.http_scope import HttpCallScope, watch_disconnect
from router.openai_errors import ApiError
from router.openai_tools import call_deltas, openai_calls
from router.tokenizer import RouterModel
from router.tool_parser import Piece, ToolParser
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
        tools: ToolParser | None = None,
    ) -> None:
        """``tools``: how a chat reply's tool calls are read (None: the reply is text)."""
        self.model, self.id, self.created, self.chat, self.logprobs = (
            model,
            request_id,
            created,
            chat,
            logprobs,
        )
        self.cache_details = cache_details
        self.tools = tools if chat else None
        self._stream = self.tools.stream() if self.tools is not None else None
        self._calls_sent = 0

    def envelope(self) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.model.name}

    def chunk(self, delta: Any, finish_reason: str | None, logprobs: Any = None) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": 0, "finish_reason": finish_reason, "logprobs": logprobs}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        return {**self.envelope(), "choices": [choice]}

    def delta_chunks(self, d: Delta) -> list[dict[str, Any]]:
        """The chunks of one delta: its text, or -- with tools -- the content and the calls it
        completes (none while the text is held; its logprobs then come in a chunk of their own)."""
        lp = self._logprobs(d.token_ids, d.logprobs, d.top_logprobs) if self.logprobs else None
        if self._stream is None:
            return [self.chunk({"content": d.text} if self.chat else d.text, None, lp)]
        deltas = self._deltas(self._stream.push(d.text))
        if not deltas:
            return [self.chunk({}, None, lp)] if lp is not None else []
        return [self.chunk(delta, None, lp if i == 0 else None) for i, delta in enumerate(deltas)]

    def final_chunks(self, done: Done) -> list[dict[str, Any]]:
        """What the reply still held, then the chunk with the finish reason."""
        held = self._deltas(self._stream.finish()) if self._stream is not None else []
        last = self.chunk({} if self.chat else "", self._finish_reason(done, self._calls_sent))
        return [*(self.chunk(delta, None) for delta in held), last]

    def _deltas(self, pieces: list[Piece]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for piece in pieces:
            if isinstance(piece, str):
                out.append({"content": piece})
            else:
                out += call_deltas(self._calls_sent, piece)
                self._calls_sent += 1
        return out

    @staticmethod
    def _finish_reason(done: Done, calls: int) -> str | None:
        """OpenAI's "tool_calls" when a reply that ended by itself called tools."""
        return "tool_calls" if calls and done.finish_reason == "stop" else done.finish_reason

    def whole(self, deltas: list[Delta], done: Done) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        ids = [t for d in deltas for t in d.token_ids]
        lps = [x for d in deltas for x in d.logprobs]
        tops = [x for d in deltas for x in d.top_logprobs]
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": done.finish_reason,
            "logprobs": self._logprobs(ids, lps, tops) if self.logprobs else None,
        }
        if self.chat and self.tools is not None:
            reply = self.tools.parse(text)
            choice["message"] = {"role": "assistant", "content": reply.content}
            if reply.calls:
                choice["message"]["tool_calls"] = openai_calls(reply.calls)
            choice["finish_reason"] = self._finish_reason(done, len(reply.calls))
            kind = "chat.completion"
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": text}
            kind = "chat.completion"
        else:
            choice["text"] = text
            kind = "text_completion"
        return {
            "id": self.id,
            "object": kind,
            "created": self.created,
            "model": self.model.name,
            "choices": [choice],
            "usage": self.usage(done.usage),
        }

    def _logprobs(self, ids: list[int], lps: list[float], tops: list[TopLogprobs]) -> Any:
        """OpenAI's logprobs object: chat's ``content`` entries (each with its ``top_logprobs``), or
        completions' parallel lists (``top_logprobs``: one {token: logprob} map per token)."""
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
                            for t, v in (tops[i] if i < len(tops) else ())
                        ],
                    }
                    for i, (s, lp) in enumerate(zip(tokens, lps, strict=False))
                ]
            }
        offsets, at = [], 0
        for s in tokens:
            offsets.append(at)
            at += len(s)
        top_maps = [{self._token(t): v for t, v in top} for top in tops] if tops else None
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
        deltas: list[Delta] = []
        done: Done | None = None
        try:
            async for event in events:
                if isinstance(event, Delta):
                    deltas.append(event)
                else:
                    done = event
        except ServingError as exc:
            raise ApiError.from_serving(exc) from None
        assert done is not None
        return JSONResponse(shape.whole(deltas, done))
    finally:
        watcher.cancel()


def model_card(model: RouterModel, created: int) -> dict[str, Any]:
    return {
        "id": model.name,
        "object": "model",
        "created": created,
        "owned_by": "pdkv",
        "max_model_len": model.context_length,
        "context_length": model.context_length,
    }
