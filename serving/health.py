"""The standard gRPC health service.  Client side: one check, or wait until serving (with a deadline) --
used by ``pdkv health HOST:PORT`` (container health checks), the router's node monitor and ``pdkv up``.
Server side: ``HealthStatus``, the servicer the router and the nodes serve.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from serving.tls import TLSFolder
from serving.tls import channel as make_channel

SERVING = "SERVING"


class HealthStatus(health.HealthServicer):
    """grpcio's health servicer, telling ``Watch`` callers only of changes: its ``set`` sends every
    watcher a message on each call, and the router and nodes set their status every health round -- a
    watcher got "SERVING" twice a second where the protocol sends one message per change."""

    def __init__(self) -> None:
        super().__init__()
        self._set: dict[str, int] = {}
        # A Check answered NOT_SERVING since the last ``set`` to it: a health monitor (the router) knows
        # this process is stopping -- a drain lingers until then (``serving/drain.py``'s ``seen``).
        self.told_stopping = threading.Event()
        self.last_check = 0.0  # monotonic time of the last Check: is anyone watching?

    def Check(self, request: Any, context: Any) -> Any:
        self.last_check = time.monotonic()
        reply = super().Check(request, context)
        if reply.status == health_pb2.HealthCheckResponse.NOT_SERVING:
            self.told_stopping.set()
        return reply

    def set(self, service: str, status: int) -> None:
        # grpcio's own lock (reentrant): its enter_graceful_shutdown holds it while it calls set; a lock
        # of ours taken first would invert the order.
        with self._lock:
            if self._set.get(service) == status:
                return
            self._set[service] = status
            if status == health_pb2.HealthCheckResponse.NOT_SERVING:
                self.told_stopping.clear()
            super().set(service, status)


def check(
    address: str,
    *,
    service: str = "",
    timeout: float = 1.0,
    channel: grpc.Channel | None = None,
    tls: TLSFolder | None = None,
) -> str:
    """The health status name of ``service`` at ``address`` ("SERVING", "NOT_SERVING", ...), or
    "UNREACHABLE: <why>" when the call fails (down, deadline, unknown service)."""
    own = channel is None
    ch = channel if channel is not None else make_channel(address, tls)
    try:
        stub = health_pb2_grpc.HealthStub(ch)
        reply = stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=timeout)
        return str(health_pb2.HealthCheckResponse.ServingStatus.Name(reply.status))
    except grpc.RpcError as exc:
        code = exc.code().name if isinstance(exc, grpc.Call) else "UNKNOWN"
        details = exc.details() if isinstance(exc, grpc.Call) else str(exc)
        return f"UNREACHABLE: {code} {details}"
    finally:
        if own:
            ch.close()


def wait_healthy(
    address: str,
    *,
    timeout: float,
    service: str = "",
    interval: float = 0.1,
    tls: TLSFolder | None = None,
) -> None:
    """Return once ``address`` reports SERVING; TimeoutError (with the last answer) after ``timeout``."""
    deadline = time.monotonic() + timeout
    with make_channel(address, tls) as channel:
        while True:
            remaining = deadline - time.monotonic()
            status = check(address, service=service, timeout=max(0.05, min(1.0, remaining)), channel=channel)
            if status == SERVING:
                return
            if time.monotonic() + interval > deadline:
                raise TimeoutError(f"{address} is not serving after {timeout:.1f}s (last answer: {status})")
            time.sleep(interval)
