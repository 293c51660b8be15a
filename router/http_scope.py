"""One HTTP call's life on the router: its scope, the pipeline run for it, and a client that leaves.

The pipeline is synchronous (it blocks on node calls), so each request runs it on a worker thread that
hands events to the event loop (``pipeline_events``).  ``HttpCallScope`` stands in for a gRPC context:
when the client disconnects (``watch_disconnect``), stops reading its response for the idle limit
(``IdleCutoff``), or the server-side deadline passes, the scope ends, which cancels the node calls, and
the nodes abort the request -- no work is left running for a client that left.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import AsyncGenerator, Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

from router.admission import AdmittedRequest
from router.auth import Access, Caller
from router.events import Event
from router.openai_errors import HTTP_STATUS
from router.pipeline import Pipeline
from router.streams import StreamWatch
from serving.errors import CallRecorder

logger = logging.getLogger(__name__)


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


async def pipeline_events(
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


async def watch_disconnect(http: Any, scope: HttpCallScope) -> None:
    """Ends ``scope`` when the client of ``http`` (a FastAPI ``Request``) disconnects."""
    while scope.is_active():
        if await http.is_disconnected():
            scope.end()
            return
        await asyncio.sleep(0.1)


class _ClientStalled(Exception):
    pass


class IdleCutoff:
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


# gRPC's name for each HTTP status this API answers with: HTTP calls are counted in the router's
# rpcs_total / errors_total beside the gRPC ones, in one vocabulary.  The statuses the gRPC codes map to
# (openai_errors.HTTP_STATUS), read backwards, and those only FastAPI and the gate answer with.
_CODE_OF_STATUS = {
    **{status: code.name for code, (status, _) in HTTP_STATUS.items()},
    405: "UNIMPLEMENTED",
    413: "INVALID_ARGUMENT",
    422: "INVALID_ARGUMENT",
    500: "INTERNAL",
}


_METHODS = frozenset({"GET", "POST", "PUT", "DELETE", "HEAD", "OPTIONS", "PATCH"})


class CallCounting:
    """ASGI wrapper: every HTTP call counted by ``"METHOD /route"`` (the route's template, never the
    client's path: unknown paths are one "unrouted" label) and its status as gRPC names it; a response
    the client left before its end (a stream it cancelled, or cut for not reading) is CANCELLED."""

    def __init__(self, app: Any, calls: CallRecorder, paths: set[str] | frozenset[str] = frozenset()) -> None:
        """``paths``: the app's routes without parameters, to name a call answered before routing (a 401)."""
        self.app = app
        self.calls = calls
        self.paths = paths

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope.get("type") != "http":
            await self.app(scope, receive, send)
            return
        status: int | None = None
        complete = False

        async def watched(message: Any) -> None:
            nonlocal status, complete
            if message["type"] == "http.response.start":
                status = int(message["status"])
            elif message["type"] == "http.response.body" and not message.get("more_body", False):
                complete = True
            await send(message)

        try:
            await self.app(scope, receive, watched)
        finally:
            route = getattr(scope.get("route"), "path", None)
            if route is None and scope.get("path") in self.paths:
                route = scope["path"]
            verb = scope.get("method", "")  # h11 takes any token as a method: never a label of its own
            method = f"{verb} {route}" if route and verb in _METHODS else "unrouted"
            if status is None or (status < 400 and not complete):
                code = "CANCELLED"
            elif status < 400:
                code = "OK"
            else:
                code = _CODE_OF_STATUS.get(status, f"HTTP_{status}")
            self.calls.record(method, code)
