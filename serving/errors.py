"""Every error at the gRPC edge maps to a status code with a message a user can act on.

Domain code raises ``ServingError(code, message)`` (or the engine's own exceptions); ``status_for``
maps any exception to ``(code, message)`` in one place, and ``abort`` ends the RPC with it.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any, NoReturn, Protocol

import grpc

from engine.driver import NODE_DRAINING, NODE_FULL, EngineOverloaded, EngineStopped
from engine.lora.manager import AdapterUnavailable, UnknownAdapter


class ServingError(Exception):
    """An error with its gRPC status code: raised by domain code, turned into a status at the edge."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(field: str, problem: str) -> ServingError:
    """INVALID_ARGUMENT naming ``field``: ``invalid("sampling.top_p", "must be in [0, 1]")``."""
    return ServingError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}")


def node_full(code: grpc.StatusCode, details: str) -> bool:
    """Whether a node's answer says it is full (``EngineOverloaded``): well, and with room later."""
    return code == grpc.StatusCode.RESOURCE_EXHAUSTED and details.startswith(NODE_FULL)


def node_draining(code: grpc.StatusCode, details: str) -> bool:
    """Whether a node refused a call because it is draining (``EngineDraining``): a planned stop."""
    return code == grpc.StatusCode.UNAVAILABLE and details.startswith(NODE_DRAINING)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ServingError):
        return exc.code, exc.message
    if isinstance(exc, EngineOverloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, EngineStopped):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, UnknownAdapter):
        return grpc.StatusCode.NOT_FOUND, str(exc)
    if isinstance(exc, AdapterUnavailable):
        return grpc.StatusCode.FAILED_PRECONDITION, str(exc)
    if isinstance(exc, ValueError):
        return grpc.StatusCode.INVALID_ARGUMENT, str(exc)
    if isinstance(exc, TimeoutError):
        return grpc.StatusCode.DEADLINE_EXCEEDED, str(exc) or "timed out"
    if isinstance(exc, grpc.RpcError) and isinstance(exc, grpc.Call):
        return exc.code(), exc.details() or ""
    return grpc.StatusCode.INTERNAL, f"internal error: {exc!r}"


def abort(context: grpc.ServicerContext, exc: BaseException) -> NoReturn:
    """End the RPC with the status ``exc`` maps to (``context.abort`` raises)."""
    code, message = status_for(exc)
    context.abort(code, message)
    raise AssertionError("unreachable: context.abort raises")  # pragma: no cover


class CallRecorder(Protocol):
    def record(self, method: str, code: str) -> None: ...


@contextmanager
def rpc_errors(context: grpc.ServicerContext, calls: CallRecorder, method: str) -> Iterator[None]:
    """Wrap a servicer method's body: count the call by status code, and end the RPC with the status
    any exception maps to."""
    try:
        yield
    except GeneratorExit:  # a streaming call's generator closed early: the client left, or its deadline
        calls.record(method, _why_closed(context).name)
        raise
    except Exception as exc:
        code, message = status_for(exc)
        if code == grpc.StatusCode.CANCELLED:  # the call's end cancelled what it waited on: which end?
            code = _why_closed(context)
        calls.record(method, code.name)
        context.abort(code, message)
    else:
        calls.record(method, "OK")


# The client's deadline runs from when it sent the call, the server's from when the call arrived: at the
# client's deadline its RST_STREAM reaches the server with this side's clock a little short of its own.
DEADLINE_SLACK_S = 0.25


def _why_closed(context: grpc.ServicerContext | None) -> grpc.StatusCode:
    """Why grpcio closed a stream early: its deadline passed (the client sees DEADLINE_EXCEEDED), else the
    client cancelled it.  ``time_remaining`` is 0 once the deadline has passed (huge without one); within
    ``DEADLINE_SLACK_S`` of it, the client's own deadline ended the call (an outside probe saw 3 of 8
    streams whose deadline passed counted CANCELLED)."""
    remaining = context.time_remaining() if context is not None else None
    if remaining is not None and remaining <= DEADLINE_SLACK_S:
        return grpc.StatusCode.DEADLINE_EXCEEDED
    return grpc.StatusCode.CANCELLED


logger = logging.getLogger(__name__)


class _Undecodable:
    """A request whose bytes did not parse as its message (a string field that is not UTF-8, a cut
    message): carried to the handler, which answers INVALID_ARGUMENT."""

    def __init__(self, exc: Exception) -> None:
        self.exc = exc


class UndecodableRequests(grpc.ServerInterceptor):
    """grpcio answers a request it cannot deserialize with INTERNAL "Exception deserializing request!",
    which says neither that the caller is at fault nor why; this makes it INVALID_ARGUMENT naming the
    message and the parser's reason.  Requests that stream in are left as grpcio handles them."""

    def intercept_service(self, continuation: Any, handler_call_details: Any) -> Any:
        handler = continuation(handler_call_details)
        if handler is None or handler.request_streaming or handler.request_deserializer is None:
            return handler
        parse, method = handler.request_deserializer, handler_call_details.method

        def tolerant(data: bytes) -> Any:
            try:
                return parse(data)
            except Exception as exc:  # protobuf's DecodeError, or a str field's UnicodeDecodeError
                return _Undecodable(exc)

        def checked(behavior: Any) -> Any:
            def run(request: Any, context: grpc.ServicerContext) -> Any:
                if isinstance(request, _Undecodable):
                    # for the operator: once a minute, no traceback (telemetry/logs.py's Throttle)
                    logger.warning("a request to %s did not parse", method, exc_info=request.exc)
                    context.abort(
                        grpc.StatusCode.INVALID_ARGUMENT,
                        f"the request to {method} does not parse ({request.exc}): a string field that is "
                        "not UTF-8, or bytes that are not this message",
                    )
                return behavior(request, context)

            return run

        make = (
            grpc.unary_stream_rpc_method_handler
            if handler.response_streaming
            else grpc.unary_unary_rpc_method_handler
        )
        behavior = handler.unary_stream if handler.response_streaming else handler.unary_unary
        return make(
            checked(behavior), request_deserializer=tolerant, response_serializer=handler.response_serializer
        )
