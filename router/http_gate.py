"""The HTTP API's gate, before any route runs: the API key, then the body's size.

FastAPI reads and parses a request's whole body before it resolves a route's dependencies, so a key
checked as a dependency came after the router had buffered whatever a caller sent -- a caller without a
key could make it hold hundreds of megabytes, and learn the body's faults (a detailed 400) before its
401.  This ASGI wrapper answers 401 from the headers alone (the first Authorization header, as the
routes read it), and 413 once a body passes ``MAX_BODY_BYTES`` (by its Content-Length, or as it
arrives), without reading further; a body within it is read here and handed to the app whole.
``/health`` (for probes), ``/version`` and the API's schema pages stay open, as vLLM's.
"""

from __future__ import annotations

from typing import Any

from fastapi.responses import JSONResponse

from router.auth import Access
from router.openai_errors import ApiError
from serving.errors import ServingError

# The largest body the API reads: far above any prompt a context holds as JSON (a 128k-token prompt's
# ids are ~1 MB of text), far below what would hurt the router to buffer.
MAX_BODY_BYTES = 16 * 1024 * 1024

OPEN_PATHS = frozenset({"/health", "/version", "/docs", "/openapi.json"})


def _answer(error: ApiError) -> JSONResponse:
    """``error`` as the app's own handlers answer it (an ASGI app: called with the gate's scope)."""
    headers = {"www-authenticate": "Bearer"} if error.status == 401 else None
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


def _too_large(size: int | None) -> ApiError:
    got = f"is {size} bytes" if size is not None else "runs past the limit"
    return ApiError(
        413,
        f"the body {got}; this server reads at most {MAX_BODY_BYTES} bytes",
        kind="invalid_request_error",
        param="body",
    )


class HttpGate:
    def __init__(self, app: Any, access: Access, max_body_bytes: int = MAX_BODY_BYTES) -> None:
        self.app = app
        self.access = access
        self.max_body_bytes = max_body_bytes

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http" or scope.get("path") in OPEN_PATHS:
            await self.app(scope, receive, send)
            return
        headers: dict[str, str] = {}
        for k, v in scope.get("headers", ()):  # the first of a repeated header, as the routes read it
            headers.setdefault(k.decode("latin-1").lower(), v.decode("latin-1"))
        client = scope.get("client")
        peer = f"{client[0]}:{client[1]}" if client else ""
        try:
            self.access.authenticate(headers.get("authorization"), peer)
        except ServingError as exc:
            await _answer(ApiError.from_serving(exc))(scope, receive, send)
            return
        length = headers.get("content-length", "")
        if length.isdigit() and int(length) > self.max_body_bytes:
            await _answer(_too_large(int(length)))(scope, receive, send)
            return
        # Read the body here, bounded, then hand it to the app whole (it would have buffered it anyway).
        chunks: list[bytes] = []
        seen = 0
        while True:
            message = await receive()
            if message["type"] != "http.request":  # the client left before sending it all
                return
            chunk = message.get("body", b"")
            seen += len(chunk)
            if seen > self.max_body_bytes:
                await _answer(_too_large(None))(scope, receive, send)
                return
            chunks.append(chunk)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Any:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()  # after the body: a disconnect, which streaming responses watch for

        await self.app(scope, replay, send)
