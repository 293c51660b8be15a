"""The OpenAI-compatible HTTP API on the router: the same pipeline as gRPC, behind FastAPI + uvicorn.

    POST /v1/chat/completions   messages -> the model's chat template -> the pipeline
    POST /v1/completions        prompt (text, or token ids) -> the pipeline
    GET  /v1/models             the served model and its context length
    GET  /health                200 only while every pool (prefill and decode) has a healthy node

``stream: true`` answers with server-sent events: one ``data: {chunk}`` per delta, a last chunk with the
finish reason, a usage chunk when ``stream_options.include_usage``, then ``data: [DONE]``.  Errors are
OpenAI-shaped (``{"error": {"message", "type", "param", "code"}}``) with the status the gRPC code maps
to (``HTTP_STATUS``); a malformed body is 400 naming the field.

Each handler only converts: the body becomes the neutral ``GenerationRequest``, which takes the one
admission path the gRPC front end takes too (``router/admission.py``: chat template, tokens, vocabulary,
context, defaults), and the pipeline's events become OpenAI's objects.

The pipeline is synchronous (it blocks on node calls), so each request runs it on a thread of its own
that hands events to the event loop.  ``HttpCallScope`` stands in for a gRPC context: when the client
disconnects (or the server-side deadline passes) the scope ends, which cancels the node calls, and the
nodes abort the request -- no work is left running for a client that left.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import socket
import threading
import time
import uuid
from collections.abc import AsyncGenerator, AsyncIterator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import grpc
from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, StreamingResponse

from router.admission import (
    Admission,
    AdmittedRequest,
    ChatPrompt,
    ChatTurn,
    FieldNames,
    GenerationRequest,
    InvalidField,
    Prompt,
    TextPrompt,
    TokenPrompt,
)
from router.auth import Access, Caller
from router.openai_schema import ChatCompletionRequest, CompletionRequest
from router.pipeline import Delta, Done, Event, Pipeline, Usage
from router.streams import StreamWatch
from router.tokenizer import RouterModel
from serving.errors import ServingError

logger = logging.getLogger(__name__)

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.RESOURCE_EXHAUSTED: (429, "rate_limit_error"),
    grpc.StatusCode.CANCELLED: (499, "cancelled"),
    grpc.StatusCode.UNAVAILABLE: (503, "service_unavailable"),
    grpc.StatusCode.DEADLINE_EXCEEDED: (504, "timeout"),
}


class ApiError(Exception):
    def __init__(
        self, status: int, message: str, *, kind: str, param: str | None = None, code: str | None = None
    ):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    @classmethod
    def invalid(cls, param: str, message: str) -> ApiError:
        return cls(400, f"{param}: {message}", kind="invalid_request_error", param=param)

    @classmethod
    def from_serving(cls, exc: ServingError) -> ApiError:
        if isinstance(exc, InvalidField):  # admission's refusals name the field: OpenAI's ``param``
            return cls(400, exc.message, kind="invalid_request_error", param=exc.field)
        status, kind = HTTP_STATUS.get(exc.code, (500, "internal_error"))
        return cls(status, exc.message, kind=kind, code=exc.code.name.lower())

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


class HttpCallScope:
    """The pipeline's view of one HTTP request (what a ``grpc.ServicerContext`` gives the gRPC path)."""

    def __init__(self, timeout_s: float | None) -> None:
        self._deadline = None if timeout_s is None else time.monotonic() + timeout_s
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []
        self._ended = False

    def time_remaining(self) -> float | None:
        return None if self._deadline is None else max(0.0, self._deadline - time.monotonic())

    def add_callback(self, callback: Callable[[], None]) -> bool:
        with self._lock:
            if self._ended:
                return False
            self._callbacks.append(callback)
            return True

    def is_active(self) -> bool:
        """False once the client left or the deadline passed (the pipeline then stops retrying)."""
        return not self._ended and (self._deadline is None or time.monotonic() < self._deadline)

    def end(self) -> None:
        """The client left (or the response is complete): run every callback once."""
        with self._lock:
            if self._ended:
                return
            self._ended = True
            callbacks, self._callbacks = self._callbacks, []
        for cb in callbacks:
            try:
                cb()
            except Exception:
                logger.exception("http: a cancel callback failed")


async def _events(
    pipeline: Pipeline,
    request: AdmittedRequest,
    scope: HttpCallScope,
    pool: ThreadPoolExecutor,
    access: Access,
    caller: Caller,
) -> AsyncGenerator[Event, None]:
    """The pipeline's events on the event loop; the pipeline itself runs on a worker thread of ``pool``
    (threads are reused: starting one per request cost ~0.2 ms of TTFT), which always runs it to its end
    (so its books close), even after the client left.  The call counts against the caller's limit until
    then."""
    loop = asyncio.get_running_loop()
    queue: asyncio.Queue[Event | BaseException | None] = asyncio.Queue()

    def run() -> None:
        try:
            with access.admitted(caller):
                for event in pipeline.generate(request, scope):
                    loop.call_soon_threadsafe(queue.put_nowait, event)
        except BaseException as exc:
            loop.call_soon_threadsafe(queue.put_nowait, exc)
        else:
            loop.call_soon_threadsafe(queue.put_nowait, None)

    pool.submit(run)
    try:
        while True:
            item = await queue.get()
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        scope.end()  # done, failed or abandoned by the client: cancel whatever still runs downstream


def create_app(
    pipeline: Pipeline,
    model: RouterModel,
    *,
    healthy: Callable[[], bool],
    request_timeout_s: float | None = 600.0,
    access: Access | None = None,
    streams: StreamWatch | None = None,
    admission: Admission | None = None,
) -> Any:
    """The app; ``access`` decides who may call (open when None), ``streams`` cuts streams whose client
    reads nothing for its idle limit, ``admission`` is the router's one admission path, shared with the
    gRPC front end (default: this model's, without a max_tokens_limit)."""
    access = access if access is not None else Access()
    admission = admission if admission is not None else Admission(model)
    app = FastAPI(title="pdkv", docs_url=None, redoc_url=None, openapi_url=None)
    # One worker per request the pipeline may admit, and a few more so a request beyond the limit
    # reaches the pipeline and gets its 429 instead of queueing for a thread.
    pool = ThreadPoolExecutor(max_workers=pipeline.max_inflight + 8, thread_name_prefix="http-pipeline")
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(exc.body(), status_code=exc.status)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        first = exc.errors()[0] if exc.errors() else {"loc": ("body",), "msg": "invalid body"}
        loc = [str(p) for p in first.get("loc", ()) if p != "body"]
        param = ".".join(loc) or "body"
        return JSONResponse(ApiError.invalid(param, str(first.get("msg"))).body(), status_code=400)

    @app.get("/health")
    async def _health() -> JSONResponse:
        ok = healthy()
        return JSONResponse({"status": "ok" if ok else "unavailable"}, status_code=200 if ok else 503)

    def caller_of(http: Request) -> Caller:
        peer = f"{http.client.host}:{http.client.port}" if http.client else ""
        try:
            return access.authenticate(http.headers.get("authorization"), peer)
        except ServingError as exc:
            raise ApiError.from_serving(exc) from None

    # A dependency: FastAPI resolves it before it validates the body, so a caller without a key learns
    # nothing about the request's shape (a 401, never a detailed 400).
    authenticated = Depends(caller_of)

    @app.get("/v1/models")
    async def _models(caller: Caller = authenticated) -> dict[str, Any]:
        return {"object": "list", "data": [_model_card(model, created)]}

    @app.get("/v1/models/{name:path}")
    async def _model(name: str, caller: Caller = authenticated) -> dict[str, Any]:
        _check_model(model, name)
        return _model_card(model, created)

    @app.post("/v1/chat/completions", response_model=None)
    async def _chat(body: ChatCompletionRequest, http: Request, caller: Caller = authenticated) -> Any:
        return await _respond(http, _chat_request(body, model), caller)

    @app.post("/v1/completions", response_model=None)
    async def _completions(body: CompletionRequest, http: Request, caller: Caller = authenticated) -> Any:
        return await _respond(http, _completion_request(body, model), caller)

    async def _respond(http: Request, asked: GenerationRequest, caller: Caller) -> Any:
        """Admit the neutral request (the one path both front ends take), run it, answer as OpenAI does."""
        try:
            request = admission.admit(asked, caller)
        except ServingError as exc:
            raise ApiError.from_serving(exc) from None
        scope = HttpCallScope(request_timeout_s)
        shape = _Shape(
            model,
            request.request_id,
            created=int(time.time()),
            chat=isinstance(asked.prompt, ChatPrompt),
            logprobs=request.params.logprobs,
            cache_details=caller.cache_details,
        )
        include_usage = asked.include_usage
        if asked.stream:
            # The first event decides the status: an overloaded router (429), no healthy node (503) or a
            # refused request (400) is answered as such, not as a 200 whose stream holds the error.
            events = _events(pipeline, request, scope, pool, access, caller)
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
        watcher = asyncio.create_task(_watch_disconnect(http, scope))
        try:
            deltas: list[Delta] = []
            done: Done | None = None
            try:
                async for event in _events(pipeline, request, scope, pool, access, caller):
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

    if streams is None:
        return app
    return _IdleCutoff(app, streams)


class _ClientStalled(Exception):
    pass


class _IdleCutoff:
    """ASGI wrapper: a send the client does not take within the idle limit (it stopped reading: the
    transport's buffer stays full) ends the response; the stream's generator is closed, which ends its
    scope and aborts the request downstream."""

    def __init__(self, app: Any, streams: StreamWatch) -> None:
        self.app = app
        self.streams = streams

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return

        idle = self.streams.idle_timeout_s

        async def send_or_cut(message: Any) -> None:
            try:
                async with asyncio.timeout(idle):  # no task per send (wait_for makes one)
                    await send(message)
            except TimeoutError:
                raise _ClientStalled from None

        try:
            await self.app(scope, receive, send_or_cut)
        except _ClientStalled:
            self.streams.record_cut()
            logger.warning(
                "http: a client read nothing of its response for %.0fs; cut",
                self.streams.idle_timeout_s,
            )


async def _watch_disconnect(http: Any, scope: HttpCallScope) -> None:
    while scope.is_active():
        if await http.is_disconnected():
            scope.end()
            return
        await asyncio.sleep(0.1)


async def _sse(
    first: Event,
    events: AsyncGenerator[Event, None],
    scope: HttpCallScope,
    shape: _Shape,
    include_usage: bool,
) -> AsyncIterator[bytes]:
    def data(obj: Any) -> bytes:
        return b"data: " + json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"

    def render(event: Event) -> list[bytes]:
        if isinstance(event, Delta):
            return [data(shape.delta_chunk(event))]
        out = [data(shape.chunk({} if shape.chat else "", event.finish_reason))]
        if include_usage:
            out.append(data({**shape.envelope(), "choices": [], "usage": shape.usage(event.usage)}))
        return out

    # aclosing + finally: however this generator ends -- done, or cancelled while a slow client's send
    # was pending -- the scope ends now (downstream work stops), not whenever it is garbage-collected.
    try:
        async with contextlib.aclosing(events) as rest:
            if shape.chat:
                yield data(shape.chunk({"role": "assistant", "content": ""}, None))
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


class _Shape:
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
    ) -> None:
        self.model, self.id, self.created, self.chat, self.logprobs = (
            model,
            request_id,
            created,
            chat,
            logprobs,
        )
        self.cache_details = cache_details

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

    def delta_chunk(self, d: Delta) -> dict[str, Any]:
        lp = self._logprobs(d.token_ids, d.logprobs) if self.logprobs else None
        return self.chunk({"content": d.text} if self.chat else d.text, None, lp)

    def whole(self, deltas: list[Delta], done: Done) -> dict[str, Any]:
        text = "".join(d.text for d in deltas)
        ids = [t for d in deltas for t in d.token_ids]
        lps = [x for d in deltas for x in d.logprobs]
        choice: dict[str, Any] = {
            "index": 0,
            "finish_reason": done.finish_reason,
            "logprobs": self._logprobs(ids, lps) if self.logprobs else None,
        }
        if self.chat:
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

    def _logprobs(self, ids: list[int], lps: list[float]) -> Any:
        tok = self.model.tokenizer
        tokens = [tok.decode([t], skip_special_tokens=False) for t in ids]
        if self.chat:
            return {
                "content": [
                    {"token": s, "logprob": lp, "bytes": list(s.encode("utf-8")), "top_logprobs": []}
                    for s, lp in zip(tokens, lps, strict=False)
                ]
            }
        offsets, at = [], 0
        for s in tokens:
            offsets.append(at)
            at += len(s)
        return {"tokens": tokens, "token_logprobs": lps, "top_logprobs": None, "text_offset": offsets}

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


def _model_card(model: RouterModel, created: int) -> dict[str, Any]:
    return {
        "id": model.name,
        "object": "model",
        "created": created,
        "owned_by": "pdkv",
        "max_model_len": model.context_length,
        "context_length": model.context_length,
    }


def _check_model(model: RouterModel, name: str) -> None:
    if name != model.name:
        raise ApiError(
            404,
            f"model {name!r} is not served here; this server serves {model.name!r} (GET /v1/models)",
            kind="not_found_error",
            param="model",
            code="model_not_found",
        )


# How this front end names a request's fields in a 400 (its ``param``).
FIELDS = FieldNames(
    text="prompt", messages="messages", token_ids="prompt", token_id="prompt.{i}", sampling=""
)


def _refuse_unserved(body: ChatCompletionRequest | CompletionRequest) -> None:
    """Fields of OpenAI's schema pdkv does not serve: refused naming them, never accepted and ignored."""
    if body.n != 1:
        raise ApiError.invalid("n", f"only n=1 is served, got {body.n}; send one request per completion")
    for name in ("presence_penalty", "frequency_penalty"):
        if getattr(body, name) != 0:
            raise ApiError.invalid(name, "penalties are not supported; leave it at 0")


def _chat_request(body: ChatCompletionRequest, model: RouterModel) -> GenerationRequest:
    """A chat completion body as the neutral request (admission checks the rest)."""
    _check_model(model, body.model)
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


def _completion_request(body: CompletionRequest, model: RouterModel) -> GenerationRequest:
    """A completion body as the neutral request (admission checks the rest)."""
    _check_model(model, body.model)
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


class HttpServer:
    """uvicorn serving ``app`` on its own thread and event loop, on a socket bound here (port 0 works)."""

    def __init__(self, app: Any, address: str, *, tls: Any = None) -> None:
        """``tls``: a ``serving.tls.TLSFolder`` -- HTTPS with its server certificate."""
        import uvicorn

        from wire.endpoints import parse_address

        host, port = parse_address(address, "--http-address")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._sock = socket.socket(family, socket.SOCK_STREAM)
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        # Accepted sockets inherit it: uvicorn writes a response's head and body separately, and with
        # Nagle on, the body waits for the client's delayed ACK (40 ms on Linux) -- every small response.
        self._sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self._sock.bind((host, port))
        self.address = f"{host}:{self._sock.getsockname()[1]}"
        ssl: dict[str, Any] = {}
        if tls is not None:
            ssl = {"ssl_certfile": str(tls.server_cert_file), "ssl_keyfile": str(tls.server_key_file)}
        config = uvicorn.Config(
            app, log_level="warning", access_log=False, lifespan="off", timeout_graceful_shutdown=2, **ssl
        )
        self._server = uvicorn.Server(config)
        self._thread = threading.Thread(target=self._run, name="router-http", daemon=True)

    def _run(self) -> None:
        self._server.run(sockets=[self._sock])

    def start(self) -> HttpServer:
        self._thread.start()
        deadline = time.monotonic() + 10.0
        while not self._server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not self._server.started:
            raise OSError(f"the HTTP API did not start on {self.address}")
        return self

    def close(self) -> None:
        self._server.should_exit = True
        self._thread.join(timeout=5.0)
        self._sock.close()
