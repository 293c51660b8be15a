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
from engine.tokenizer import IncrementalDetokenizer
from router.admission import AdmittedRequest, GenerationRequest, TextPrompt
from router.events import Delta, Done, Event, Usage, total_usage
from router.http_scope import HttpCallScope, watch_disconnect
from router.openai_errors import ApiError
from router.openai_tools import call_deltas, openai_calls
from router.tokenizer import RouterModel
from router.tool_parser import Piece, ToolParser
from serving.errors import ServingError


def non_finite() -> ApiError:
    """What a client gets when the model produced a NaN or inf score (JSON has no such number): broken
    weights or adapter, which the loaders refuse -- so never, short of a numerical fault."""
    return ApiError(
        500, "the model produced a score that is not a finite number (NaN or inf)", kind="internal_error"
    )


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
        tools: ToolParser | None = None,
        served_as: str | None = None,
    ) -> None:
        """``served_as``: the ``model`` the answer names -- the LoRA adapter the request ran under, as
        vLLM answers (None: the base model).  ``n``: the request's choices (a stream's usage chunk waits
        for the last one's end); ``echo``: the prompt every completion choice starts with (completions'
        ``echo``); ``tools``: how a chat reply's tool calls are read (None: the reply is text), each
        choice's on its own."""
        self.model, self.id, self.created, self.chat, self.logprobs = (
            model,
            request_id,
            created,
            chat,
            logprobs,
        )
        self.cache_details = cache_details
        self.served_as = served_as or model.name
        self.n = n
        self.echo = echo
        self._echoed: set[int] = set()  # the choices whose stream has had the prompt
        self.tools = tools if chat else None
        self._streams = {i: self.tools.stream() for i in range(n)} if self.tools is not None else {}
        self._calls_sent = dict.fromkeys(range(n), 0)  # per choice
        self._offsets = {i: _Offsets(model) for i in range(n)}  # per choice: a stream's text_offset so far

    def envelope(self) -> dict[str, Any]:
        kind = "chat.completion.chunk" if self.chat else "text_completion"
        return {"id": self.id, "object": kind, "created": self.created, "model": self.served_as}

    def chunk(
        self, delta: Any, finish_reason: str | None, logprobs: Any = None, index: int = 0
    ) -> dict[str, Any]:
        choice: dict[str, Any] = {"index": index, "finish_reason": finish_reason, "logprobs": logprobs}
        if self.chat:
            choice["delta"] = delta
        else:
            choice["text"] = delta
        return {**self.envelope(), "choices": [choice]}

    def delta_chunks(self, d: Delta) -> list[dict[str, Any]]:
        """The chunks of one delta: its text (after the prompt, in a choice's first chunk, with echo), or
        -- with tools -- the content and the calls it completes (none while the text is held; its
        logprobs then come in a chunk of their own)."""
        ids, text = d.token_ids, d.text
        lps: list[float | None] = list(d.logprobs)
        tops: list[TopLogprobs | None] = list(d.top_logprobs)
        echoed = 0
        if self.echo is not None and d.index not in self._echoed:  # a choice's first chunk: the prompt first
            self._echoed.add(d.index)
            self.echo.seen(d)
            echoed = len(self.echo.token_ids)
            ids, text = [*self.echo.token_ids, *ids], self.echo.text + text
            lps, tops = [*self.echo.logprobs(), *lps], [*self.echo.top_logprobs(), *tops]
        # completions' offsets run on through the stream
        lp = self._logprobs(ids, lps, tops, self._offsets[d.index], echoed) if self.logprobs else None
        stream = self._streams.get(d.index)
        if stream is None:
            return [self.chunk({"content": text} if self.chat else text, None, lp, d.index)]
        deltas = self._deltas(d.index, stream.push(text))
        if not deltas:
            return [self.chunk({}, None, lp, d.index)] if lp is not None else []
        return [self.chunk(delta, None, lp if i == 0 else None, d.index) for i, delta in enumerate(deltas)]

    def final_chunks(self, done: Done) -> list[dict[str, Any]]:
        """What the choice's reply still held, then the chunk with its finish reason."""
        stream = self._streams.get(done.index)
        held = self._deltas(done.index, stream.finish()) if stream is not None else []
        reason = self._finish_reason(done, self._calls_sent[done.index])
        last = self.chunk({} if self.chat else "", reason, index=done.index)
        return [*(self.chunk(delta, None, index=done.index) for delta in held), last]

    def _deltas(self, index: int, pieces: list[Piece]) -> list[dict[str, Any]]:
        out: list[dict[str, Any]] = []
        for piece in pieces:
            if isinstance(piece, str):
                out.append({"content": piece})
            else:
                out += call_deltas(self._calls_sent[index], piece)
                self._calls_sent[index] += 1
        return out

    @staticmethod
    def _finish_reason(done: Done, calls: int) -> str | None:
        """OpenAI's "tool_calls" when a reply that ended by itself called tools."""
        return "tool_calls" if calls and done.finish_reason == "stop" else done.finish_reason

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
            "model": self.served_as,
            "choices": [self._choice(deltas, done) for deltas, done in choices],
            "usage": self.usage(total_usage([done.usage for _, done in choices])),
        }

    def _choice(self, deltas: list[Delta], done: Done) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        ids = [t for d in deltas for t in d.token_ids]
        lps: list[float | None] = [x for d in deltas for x in d.logprobs]
        tops: list[TopLogprobs | None] = [x for d in deltas for x in d.top_logprobs]
        echoed = 0
        if self.echo is not None:
            echoed = len(self.echo.token_ids)
            ids, text = [*self.echo.token_ids, *ids], self.echo.text + text
            lps, tops = [*self.echo.logprobs(), *lps], [*self.echo.top_logprobs(), *tops]
        offsets = _Offsets(self.model)
        choice: dict[str, Any] = {
            "index": done.index,
            "finish_reason": done.finish_reason,
            "logprobs": self._logprobs(ids, lps, tops, offsets, echoed) if self.logprobs else None,
        }
        if self.chat and self.tools is not None:
            reply = self.tools.parse(text)
            choice["message"] = {"role": "assistant", "content": reply.content}
            if reply.calls:
                choice["message"]["tool_calls"] = openai_calls(reply.calls)
            choice["finish_reason"] = self._finish_reason(done, len(reply.calls))
        elif self.chat:
            choice["message"] = {"role": "assistant", "content": text}
        else:
            choice["text"] = text
        return choice

    def _logprobs(
        self,
        ids: list[int],
        lps: list[float | None],
        tops: list[TopLogprobs | None],
        offsets: _Offsets,
        echoed: int = 0,
    ) -> Any:
        """OpenAI's logprobs object: chat's ``content`` entries (each with its ``top_logprobs``; ``bytes``
        the token's own, a piece of a UTF-8 character as it is), or completions' parallel lists
        (``top_logprobs``: one {token: logprob} map per token; None where a position has none: an echoed
        prompt's first token; ``text_offset`` from ``offsets``, where a stream's earlier chunks left it; the
        first ``echoed`` tokens are the echoed prompt's)."""
        tokens = [self._token(t) for t in ids]
        if self.chat:
            raw = self.model.grammars.token_bytes
            return {
                "content": [
                    {
                        "token": s,
                        "logprob": lp,
                        "bytes": list(raw(t)),
                        "top_logprobs": [
                            {"token": self._token(alt), "logprob": v, "bytes": list(raw(alt))}
                            for alt, v in ((tops[i] or ()) if i < len(tops) else ())
                        ],
                    }
                    for i, (t, s, lp) in enumerate(zip(ids, tokens, lps, strict=False))
                ]
            }
        # OpenAI's rule: the sampled token's logprob is always in its map ("up to logprobs+1 elements")
        # -- logprobs 0 too (no alternatives: the map holds the token alone), so that a harness may always
        # read top_logprobs[i][tokens[i]]
        top_maps: list[dict[str, float] | None] = []
        for i, (token, lp) in enumerate(zip(tokens, lps, strict=False)):
            top = tops[i] if i < len(tops) else ()
            if top is None or lp is None:
                top_maps.append(None)
                continue
            top_map = {self._token(t): v for t, v in top}
            top_map.setdefault(token, lp)
            top_maps.append(top_map)
        prompt = offsets.echo(ids[:echoed], self.echo.text) if echoed and self.echo is not None else []
        return {
            "tokens": tokens,
            "token_logprobs": lps,
            "top_logprobs": top_maps,
            "text_offset": prompt + offsets.of(ids[echoed:]),
        }

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
        try:
            return JSONResponse(shape.whole(list(zip(deltas, ended, strict=True))))
        except ValueError:  # a NaN or inf (JSON has neither): a clear error, not a bare 500 or bad JSON
            raise non_finite() from None
    finally:
        watcher.cancel()


class _Offsets:
    """Completions' ``text_offset``: where each token's text starts in the choice's text, counted as the
    text was made -- by decoding the tokens in order.  A token that holds only part of a character's
    UTF-8 bytes adds nothing until the character is whole: an outside probe found each piece of a split
    emoji moving every later offset by one (each piece, decoded alone, is U+FFFD)."""

    def __init__(self, model: RouterModel) -> None:
        self._model = model
        self._text: IncrementalDetokenizer | None = None  # made on first use: completions' logprobs only
        self._at = 0

    def echo(self, ids: list[int], text: str) -> list[int]:
        """The echoed prompt's offsets, decoded as its echo was made (special tokens kept: ``echo_of``)
        and kept within its ``text`` (the client's own, where a decode would not give it back exactly);
        the completion's offsets then start at the text's end, from a fresh decode as the engine's."""
        stream, at, out = self._model.tokenizer.stream(skip_special_tokens=False), 0, []
        for token_id in ids:
            out.append(min(at, len(text)))
            at += len(stream.push(token_id))
        self._at, self._text = len(text), None
        return out

    def of(self, ids: list[int]) -> list[int]:
        if self._text is None:
            self._text = self._model.tokenizer.stream(skip_special_tokens=True)
        out = []
        for token_id in ids:
            out.append(self._at)
            self._at += len(self._text.push(token_id))
        return out


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


def model_card(
    model: RouterModel, created: int, numerics: tuple[str, bool] = ("", False), context: int = 0
) -> dict[str, Any]:
    """``numerics``: the nodes' dtype and whether they all run deterministic (``router.nodes.numerics``);
    ``context``: the longest request admitted (``Admission.context_length``; 0: the model's)."""
    dtype, deterministic = numerics
    context = context or model.context_length
    return {
        "id": model.name,
        "object": "model",
        "created": created,
        "owned_by": "pdkv",
        "max_model_len": context,
        "context_length": context,
        "dtype": dtype,
        "deterministic": deterministic,
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
