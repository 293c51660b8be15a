"""One engine request inside one gRPC call: submit, stream its outputs, end it with the right status.

``EngineCall`` ties a request's life to the RPC's: a client cancel or an expired deadline ends the RPC,
gRPC runs the callbacks registered with ``context.add_callback``, and the callback aborts the request in
the engine (freeing its blocks).  The outputs the call yields are the engine's own ``RequestOutput``s;
a request the engine ended with "abort" (the node is shutting down) or "error" becomes UNAVAILABLE or
INTERNAL.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc

from engine.driver import EngineDriver, EngineRequest, RequestStream
from engine.outputs import RequestOutput
from serving.errors import ServingError

# The engine thread answers a submit between two steps; this bounds the wait when the call has no deadline.
SUBMIT_TIMEOUT_S = 30.0
# grpc reports "no deadline" as a time remaining of decades; anything beyond this counts as none.
NO_DEADLINE_S = 1e6


def time_remaining(context: Any) -> float | None:
    """Seconds left of the call's deadline, or None when the client set no deadline."""
    remaining = context.time_remaining()
    if remaining is None or not remaining < NO_DEADLINE_S:
        return None
    return float(remaining)


class EngineCall:
    """Submit ``request`` to ``driver`` on behalf of the RPC ``context``; iterate to get its outputs."""

    def __init__(self, driver: EngineDriver, request: EngineRequest, context: grpc.ServicerContext) -> None:
        self.driver = driver
        self.request_id = request.request_id
        self.context = context
        remaining = time_remaining(context)
        timeout = SUBMIT_TIMEOUT_S if remaining is None else min(remaining, SUBMIT_TIMEOUT_S)
        try:
            self.stream: RequestStream = driver.submit(request, timeout=max(timeout, 0.0))
        except TimeoutError as exc:
            raise ServingError(
                grpc.StatusCode.DEADLINE_EXCEEDED,
                f"the engine did not accept request {request.request_id!r} within {timeout:.1f}s",
            ) from exc
        # Runs when the RPC ends for any reason; aborting a finished request is a no-op.  add_callback
        # returns False when the RPC has already ended (a client that cancelled at once): abort now, or the
        # request runs on with nobody to read it.
        if not context.add_callback(self._on_rpc_done):
            self._on_rpc_done()

    def _on_rpc_done(self) -> None:
        if not self.stream.finished:
            self.driver.abort(self.request_id)

    def outputs(self) -> Iterator[RequestOutput]:
        """The request's outputs up to and including the finished one (never "abort" or "error")."""
        while True:
            out = self.stream.get(timeout=self._wait_s())
            if out is None:
                if not self.context.is_active():
                    self.driver.abort(self.request_id)
                    raise ServingError(grpc.StatusCode.CANCELLED, "the call ended before the request did")
                continue
            if out.finished and out.finish_reason == "abort":
                raise ServingError(
                    grpc.StatusCode.UNAVAILABLE,
                    f"request {self.request_id!r} was aborted: the node is shutting down or the call "
                    "was cancelled; retry on another node",
                )
            if out.finished and out.finish_reason == "error":
                raise ServingError(
                    grpc.StatusCode.INTERNAL, f"the engine failed request {self.request_id!r}: {out.error}"
                )
            yield out
            if out.finished:
                return

    def _wait_s(self) -> float:
        """Wake up at least every second to notice a call that ended without its callback running."""
        remaining = time_remaining(self.context)
        return 1.0 if remaining is None else max(0.01, min(1.0, remaining + 0.05))
