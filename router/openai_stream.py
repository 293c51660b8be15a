"""The OpenAI-compatible API's streamed answer (``stream: true``): server-sent events.

One ``data: {chunk}`` per delta (a chat stream opens with the assistant's role; with tools, a delta's
content and the tool calls it completes, ``router/openai_tools.py``), a last chunk with the finish
reason, a usage chunk when ``stream_options.include_usage``, then ``data: [DONE]``.  The first event
decides the status: a refusal before any output is answered with its own status, not as a 200 whose
stream holds the error; an error after that goes in-band.  However the stream ends -- done, failed, or
its client gone -- the call's scope ends with it, which aborts the request downstream.
"""

from __future__ import annotations

import contextlib
import json
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

from fastapi.responses import StreamingResponse

from router.events import Delta, Event, Usage, total_usage
from router.http_scope import HttpCallScope
from router.openai_errors import ApiError
from router.openai_responses import ResponseShape, non_finite
from serving.errors import ServingError


async def stream_response(
    events: AsyncGenerator[Event, None], scope: HttpCallScope, shape: ResponseShape, include_usage: bool
) -> StreamingResponse:
    """The request's events as an SSE response, once its first event came."""
    # The first event decides the status: an overloaded router (429), no healthy node (503) or a
    # refused request (400) is answered as such, not as a 200 whose stream holds the error.
    try:
        first = await events.__anext__()
    except ServingError as exc:
        await events.aclose()
        raise ApiError.from_serving(exc) from None
    except BaseException:
        await events.aclose()
        raise
    return StreamingResponse(
        _sse(first, events, scope, shape, include_usage),
        media_type="text/event-stream",
        headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
    )


async def _sse(
    first: Event,
    events: AsyncGenerator[Event, None],
    scope: HttpCallScope,
    shape: ResponseShape,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    def data(obj: Any) -> bytes:
        try:
            text = json.dumps(obj, ensure_ascii=False, separators=(",", ":"), allow_nan=False)
        except ValueError:  # a NaN or inf: not JSON -- the error in-band instead of an invalid chunk
            text = json.dumps(non_finite().body())
        return b"data: " + text.encode() + b"\n\n"

    usages: dict[int, Usage] = {}

    def render(event: Event) -> list[bytes]:
        if isinstance(event, Delta):
            return [data(chunk) for chunk in shape.delta_chunks(event)]
        out = [data(chunk) for chunk in shape.final_chunks(event)]
        usages[event.index] = event.usage
        if include_usage and len(usages) == shape.n:  # after the last choice's end: the request's usage
            usage = total_usage([usages[i] for i in sorted(usages)])
            out.append(data({**shape.envelope(), "choices": [], "usage": shape.usage(usage)}))
        return out

    # aclosing + finally: however this generator ends -- done, or cancelled while a slow client's send
    # was pending -- the scope ends now (downstream work stops), not whenever it is garbage-collected.
    try:
        async with contextlib.aclosing(events) as rest:
            if shape.chat:
                for i in range(shape.n):
                    yield data(shape.chunk({"role": "assistant", "content": ""}, None, index=i))
            for chunk in render(first):
                yield chunk
            try:
                async for event in rest:
                    for chunk in render(event):
                        yield chunk
            except ServingError as exc:
                yield data(ApiError.from_serving(exc).body())  # the status is sent: the error goes in-band
        yield b"data: [DONE]\n\n"
    finally:
        scope.end()
