"""Every error at the gRPC edge maps to a status code with a message a user can act on.

Domain code raises ``ServingError(code, message)`` (or the engine's own exceptions); ``status_for``
maps any exception to ``(code, message)`` in one place, and ``abort`` ends the RPC with it.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import NoReturn, Protocol

import grpc

from engine.driver import EngineOverloaded, EngineStopped
from engine.lora.manager import UnknownAdapter


class ServingError(Exception):
    """An error with its gRPC status code: raised by domain code, turned into a status at the edge."""

    def __init__(self, code: grpc.StatusCode, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


def invalid(field: str, problem: str) -> ServingError:
    """INVALID_ARGUMENT naming ``field``: ``invalid("sampling.top_p", "must be in (0, 1]")``."""
    return ServingError(grpc.StatusCode.INVALID_ARGUMENT, f"{field}: {problem}")


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    if isinstance(exc, ServingError):
        return exc.code, exc.message
    if isinstance(exc, EngineOverloaded):
        return grpc.StatusCode.RESOURCE_EXHAUSTED, str(exc)
    if isinstance(exc, EngineStopped):
        return grpc.StatusCode.UNAVAILABLE, str(exc)
    if isinstance(exc, UnknownAdapter):
        return grpc.StatusCode.NOT_FOUND, str(exc)
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
    except Exception as exc:
        code, message = status_for(exc)
        calls.record(method, code.name)
        context.abort(code, message)
    else:
        calls.record(method, "OK")
