"""The OpenAI-compatible API's errors: ``ApiError``, OpenAI-shaped (``{"error": {"message", "type",
"param", "code"}}``), and ``HTTP_STATUS``, the HTTP status and error type each gRPC status code maps to.

A ``ServingError`` becomes an ``ApiError`` with the status its code maps to (500 when unmapped); an
admission refusal (``InvalidField``) becomes a 400 whose ``param`` names the field.
"""

from __future__ import annotations

from typing import Any

import grpc

from router.admission import InvalidField
from serving.errors import ServingError

HTTP_STATUS = {
    grpc.StatusCode.INVALID_ARGUMENT: (400, "invalid_request_error"),
    grpc.StatusCode.UNAUTHENTICATED: (401, "authentication_error"),
    grpc.StatusCode.PERMISSION_DENIED: (403, "permission_error"),
    grpc.StatusCode.NOT_FOUND: (404, "not_found_error"),
    grpc.StatusCode.FAILED_PRECONDITION: (409, "conflict_error"),  # the server's state (a changed adapter)
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
