"""The OpenAI-compatible HTTP API on the router: the FastAPI app and its routes, and the uvicorn server.

    POST /v1/chat/completions   messages -> the model's chat template -> the pipeline
    POST /v1/completions        prompt (text, or token ids) -> the pipeline
    GET  /v1/models             the served model and its context length, and its LoRA adapters
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter    run-time adapters (router/openai_lora.py)
    GET  /health                200 only while every pool (prefill and decode) has a healthy node

The same pipeline as gRPC, behind FastAPI + uvicorn.  Each handler only converts: the body
(``router/openai_schema.py``) becomes the neutral ``GenerationRequest`` (``router/openai_requests.py``),
which takes the one admission path the gRPC front end takes too (``router/admission.py``: chat template,
tokens, vocabulary, context, defaults); the pipeline runs on a worker thread under an ``HttpCallScope``
that ends when the client leaves (``router/http_scope.py``), and its events become OpenAI's objects --
one JSON answer (``router/openai_responses.py``) or, with ``stream: true``, server-sent events
(``router/openai_stream.py``).  Errors are OpenAI-shaped with the status the gRPC code maps to
(``router/openai_errors.py``); a malformed body is 400 naming the field.
"""

from __future__ import annotations

import asyncio
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from fastapi import Depends, FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from router.admission import Admission, ChatPrompt, GenerationRequest
from router.auth import Access, Caller
from router.http_gate import HttpGate
from router.http_scope import CallCounting, HttpCallScope, IdleCutoff, pipeline_events
from router.nodes import pool_numerics
from router.openai_errors import ApiError
from router.openai_lora import adapter_cards, add_lora_routes
from router.openai_requests import chat_request, check_model, completion_request
from router.openai_responses import ResponseShape, echo_of, model_card, whole_response
from router.openai_schema import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from router.openai_stream import stream_response
from router.openai_tokens import detokenize, tokenize, version
from router.pipeline import Pipeline
from router.streams import StreamWatch
from router.tokenizer import RouterModel
from serving.errors import CallRecorder, ServingError

# Fields a body of another endpoint serves: the refusal says where (only chat has response_format).
_ELSEWHERE = {
    "response_format": "is served on /v1/chat/completions; on /v1/completions send structured_outputs "
    "({json: SCHEMA}, {regex: ...}, {choice: [...]} or {grammar: ...})",
}


def _union_branch(part: Any) -> bool:
    """Whether a part of a pydantic error's path is the union branch it tried (``str``, ``list[str]``),
    not a field or an index."""
    return isinstance(part, str) and (part in ("str", "int", "float", "bool", "dict", "list") or "[" in part)


def create_app(
    pipeline: Pipeline,
    model: RouterModel,
    *,
    healthy: Callable[[], bool],
    request_timeout_s: float | None = 600.0,
    access: Access | None = None,
    streams: StreamWatch | None = None,
    admission: Admission | None = None,
    calls: CallRecorder | None = None,
) -> Any:
    """The app; ``access`` decides who may call (open when None), ``streams`` cuts streams whose client
    reads nothing for its idle limit, ``admission`` is the router's one admission path, shared with the
    gRPC front end (default: this model's, without a max_tokens_limit), ``calls`` counts every call by
    route and status (the router's rpcs_total)."""
    access = access if access is not None else Access()
    admission = admission if admission is not None else Admission(model)
    # The OpenAPI docs page (/docs, /openapi.json): every body's fields, served and refused alike.
    app = FastAPI(title="pdkv", docs_url="/docs", redoc_url=None, openapi_url="/openapi.json")
    # One worker per request the pipeline may admit, and a few more so a request beyond the limit
    # reaches the pipeline and gets its 429 instead of queueing for a thread.
    pool = ThreadPoolExecutor(max_workers=pipeline.max_inflight + 8, thread_name_prefix="http-pipeline")
    created = int(time.time())

    @app.exception_handler(ApiError)
    async def _api_error(_: Request, exc: ApiError) -> JSONResponse:
        # 409: the server's state, which a retry would meet again (the openai SDK retries 409s unless told)
        headers = {"x-should-retry": "false"} if exc.status == 409 else None
        return JSONResponse(exc.body(), status_code=exc.status, headers=headers)

    @app.exception_handler(RequestValidationError)
    async def _bad_body(_: Request, exc: RequestValidationError) -> JSONResponse:
        first: dict[str, Any] = (
            dict(exc.errors()[0]) if exc.errors() else {"loc": ("body",), "msg": "invalid body"}
        )
        if first.get("type") == "json_invalid":  # its loc is the byte offset, not a field
            at = [p for p in first.get("loc", ()) if p != "body"]
            where = f" at byte {at[0]}" if at else ""
            error = first.get("ctx", {}).get("error", first.get("msg"))
            return JSONResponse(
                ApiError.invalid("body", f"not valid JSON{where} ({error})").body(), status_code=400
            )
        # pydantic names a union's branch in the path (messages.0.content.str): the field is what counts
        loc = [str(p) for p in first.get("loc", ()) if p != "body" and not _union_branch(p)]
        if first.get("type") == "unencodable_text":  # found by the body's own check, below the body
            loc.append(str(first.get("ctx", {}).get("path", "")))
        param = ".".join(loc) or "body"
        message = str(first.get("msg"))
        if first.get("type") == "literal_error":  # say what was sent: a "custom" tool, a "web_search" ...
            message = f"{message}, got {first.get('input')!r}"
        if first.get("type") == "extra_forbidden":  # a field in none of openai_schema's three kinds
            message = _ELSEWHERE.get(param) or (
                "is not a field this server serves or can ignore (it could change the output); "
                "see GET /docs for the fields served"
            )
        return JSONResponse(ApiError.invalid(param, message).body(), status_code=400)

    @app.exception_handler(Exception)
    async def _bug(_: Request, exc: Exception) -> JSONResponse:
        """A fault of this server's own (a bug, never the request's): still OpenAI's error shape, with no
        internals; the traceback goes to the router's log (Starlette re-raises it to uvicorn's logger)."""
        error = ApiError(
            500, f"internal error ({type(exc).__name__}; logged by the router)", kind="internal_error"
        )
        return JSONResponse(error.body(), status_code=500)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(http: Request, exc: StarletteHTTPException) -> JSONResponse:
        """FastAPI's own refusals (a body that is not UTF-8, an unknown path, a wrong method) in OpenAI's
        error shape, as every other error of this API."""
        kind = "invalid_request_error" if exc.status_code < 500 else "internal_error"
        error = ApiError(exc.status_code, str(exc.detail), kind=kind)
        if exc.status_code == 400 and exc.detail == "There was an error parsing the body":
            try:  # FastAPI's answer to bytes json.loads cannot take: not UTF-8, or nested too deeply
                (await http.body()).decode("utf-8")
                problem = "JSON this server cannot parse (nested too deeply, or a number too long)"
                error = ApiError.invalid("body", problem)
            except UnicodeDecodeError as bad:
                error = ApiError.invalid("body", f"not valid JSON at byte {bad.start} (JSON text is UTF-8)")
        return JSONResponse(error.body(), status_code=exc.status_code, headers=getattr(exc, "headers", None))

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

    # The caller a route runs for.  HttpGate (router/http_gate.py) has refused a request without a valid
    # key already, before its body was read: a caller without a key learns nothing about the request's
    # shape (a 401, never a detailed 400) and costs no buffering.
    authenticated = Depends(caller_of)

    def numerics() -> tuple[str, bool]:
        return pool_numerics(pipeline.prefill_pool, pipeline.decode_pool)

    @app.get("/v1/models")
    async def _models(caller: Caller = authenticated) -> dict[str, Any]:
        return {
            "object": "list",
            "data": [
                model_card(model, created, numerics(), admission.context_length),
                *adapter_cards(model, admission.adapters, created, admission.context_length),
            ],
        }

    @app.get("/v1/models/{name:path}")
    async def _model(name: str, caller: Caller = authenticated) -> dict[str, Any]:
        if check_model(model, name, admission.adapters) is None:
            return model_card(model, created, numerics(), admission.context_length)
        cards = adapter_cards(model, admission.adapters, created, admission.context_length)
        return next(c for c in cards if c["id"] == name)

    add_lora_routes(app, admission.adapters, authenticated, model.name)

    @app.post("/tokenize")
    async def _tokenize(body: TokenizeRequest, caller: Caller = authenticated) -> dict[str, Any]:
        return tokenize(body, model, admission)

    @app.post("/detokenize")
    async def _detokenize(body: DetokenizeRequest, caller: Caller = authenticated) -> dict[str, Any]:
        return detokenize(body, model)

    @app.get("/version")
    async def _version() -> dict[str, Any]:
        return version()

    @app.post("/v1/chat/completions", response_model=None)
    async def _chat(body: ChatCompletionRequest, http: Request, caller: Caller = authenticated) -> Any:
        return await _respond(http, chat_request(body, model, admission.adapters), caller)

    @app.post("/v1/completions", response_model=None)
    async def _completions(body: CompletionRequest, http: Request, caller: Caller = authenticated) -> Any:
        asked = completion_request(body, model, admission.adapters)
        return await _respond(http, asked, caller, echo=body.echo)

    async def _respond(http: Request, asked: GenerationRequest, caller: Caller, echo: bool = False) -> Any:
        """Admit the neutral request (the one path both front ends take), run it, answer as OpenAI does."""
        try:
            # Off the event loop: admission tokenizes, renders the template and may compile a grammar.
            request = await asyncio.to_thread(admission.admit, asked, caller)
        except ServingError as exc:
            raise ApiError.from_serving(exc) from None
        scope = HttpCallScope(request_timeout_s)
        shape = ResponseShape(
            model,
            request.request_id,
            created=int(time.time()),
            chat=isinstance(asked.prompt, ChatPrompt),
            logprobs=request.params.logprobs,
            cache_details=caller.cache_details,
            n=request.n,
            echo=echo_of(asked, request, model) if echo else None,
            tools=request.tools,
            served_as=asked.adapter,
        )
        events = pipeline_events(pipeline, request, scope, pool, access, caller)
        if asked.stream:
            return await stream_response(events, scope, shape, asked.include_usage)
        return await whole_response(events, http, scope, shape)

    wrapped: Any = app if streams is None else IdleCutoff(app, streams)
    wrapped = HttpGate(wrapped, access)  # the key, then the body's size, before FastAPI reads the body
    if calls is None:
        return wrapped
    static = {path for path in (getattr(r, "path", "") for r in app.routes) if path and "{" not in path}
    return CallCounting(wrapped, calls, static)


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
        try:
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise OSError(f"cannot listen on {address} for HTTP: {exc.strerror}") from exc
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
