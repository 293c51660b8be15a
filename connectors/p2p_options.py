"""The ``p2p`` connector's options, and where its block server's endpoint is found by the scheduler half
of the same engine (the two halves share no state, so the worker half publishes the endpoint it bound on a
process-wide board keyed by the engine; ``connectors/p2p.py`` is the connector)."""

from __future__ import annotations

import threading
import weakref
from dataclasses import dataclass

from engine.connector.base import ConnectorContext, ConnectorOptionsError
from wire.curve import CurveKeys
from wire.endpoints import is_loopback

_WILDCARD_HOSTS = ("*", "0.0.0.0", "::", "[::]")


# ---- options ------------------------------------------------------------------------------------------


def _fail(key: str, message: str) -> ConnectorOptionsError:
    return ConnectorOptionsError(f"connector 'p2p': option {key!r} {message}")


def _split_tcp(endpoint: str) -> tuple[str, str]:
    """``tcp://host:port`` -> (host, port); ``ValueError`` if it is not that shape."""
    host, sep, port = endpoint.removeprefix("tcp://").rpartition(":")
    if not sep or not host or not port.isdigit() or not 0 <= int(port) <= 65535:
        raise ValueError(endpoint)
    return host, port


@dataclass(frozen=True)
class P2POptions:
    bind: str = "tcp://127.0.0.1:0"
    advertise_host: str = ""
    lease_s: float = 30.0
    pull_timeout_s: float = 30.0
    recv_timeout_s: float = 5.0
    max_in_flight: int = 4
    batch_bytes: int = 8 << 20
    window: int = 2
    stop_timeout_s: float = 5.0
    # Serve blocks on a non-loopback address without CURVE ($PDKV_CURVE_DIR): refused unless set.
    insecure: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.bind, str) or not self.bind.startswith(("tcp://", "ipc://")):
            raise _fail("bind", f"must be a tcp://host:port or ipc://path address, got {self.bind!r}")
        if not isinstance(self.advertise_host, str) or any(c in self.advertise_host for c in "/ \t"):
            raise _fail("advertise_host", f"must be a host name or address, got {self.advertise_host!r}")
        if self.bind.startswith("tcp://"):
            try:
                host, _ = _split_tcp(self.bind)
            except ValueError:
                raise _fail(
                    "bind", f"must look like tcp://host:port (port 0 picks one), got {self.bind!r}"
                ) from None
            if host in _WILDCARD_HOSTS and not self.advertise_host:
                raise _fail(
                    "advertise_host", f"must be set when 'bind' listens on all interfaces ({self.bind})"
                )
            if not is_loopback(host) and not self.insecure and CurveKeys.from_env() is None:
                raise _fail(
                    "bind",
                    f"listens on {host} without CURVE: anyone who reaches it could read prompts' KV; set "
                    "$PDKV_CURVE_DIR (pdkv up --secure does), bind a loopback address, or set option "
                    "'insecure': true on a network you trust",
                )
        elif len(self.bind) <= len("ipc://"):
            raise _fail("bind", "must name a path after ipc://")
        for key in ("lease_s", "pull_timeout_s", "recv_timeout_s", "stop_timeout_s"):
            value = getattr(self, key)
            if not isinstance(value, (int, float)) or isinstance(value, bool) or not value > 0:
                raise _fail(key, f"must be a positive number of seconds, got {value!r}")
        for key, top in (("max_in_flight", 256), ("window", 64), ("batch_bytes", 1 << 31)):
            value = getattr(self, key)
            if not isinstance(value, int) or isinstance(value, bool) or not 0 < value <= top:
                raise _fail(key, f"must be an int in [1, {top}], got {value!r}")

    def advertised(self, bound: str) -> str:
        """The endpoint peers connect to, given the one actually bound."""
        if not self.advertise_host or not bound.startswith("tcp://"):
            return bound
        _, port = _split_tcp(bound)
        host = f"[{self.advertise_host}]" if ":" in self.advertise_host else self.advertise_host
        return f"tcp://{host}:{port}"

    @property
    def static_endpoint(self) -> str | None:
        """The advertised endpoint when the options fix it (no port chosen at bind time), else None."""
        if self.bind.startswith("ipc://"):
            return self.bind
        _, port = _split_tcp(self.bind)
        return self.advertised(self.bind) if int(port) else None


class _EndpointBoard:
    """Where a worker half publishes the endpoint it bound, for the scheduler half of the same engine.

    Keyed by the ``ConnectorContext`` the engine hands both halves (by identity; by equality when exactly
    one published context is equal, e.g. a test that built the halves with equal contexts).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._entries: dict[int, tuple[weakref.ref[ConnectorContext], str]] = {}

    def publish(self, context: ConnectorContext, endpoint: str) -> None:
        with self._lock:
            self._entries[id(context)] = (weakref.ref(context), endpoint)

    def retract(self, context: ConnectorContext) -> None:
        with self._lock:
            entry = self._entries.get(id(context))
            if entry is not None and entry[0]() is context:
                del self._entries[id(context)]

    def lookup(self, context: ConnectorContext) -> str | None:
        with self._lock:
            entry = self._entries.get(id(context))
            if entry is not None and entry[0]() is context:
                return entry[1]
            equal = [ep for ref, ep in self._entries.values() if ref() == context]
            return equal[0] if len(equal) == 1 else None


BOARD = _EndpointBoard()


# ---- metadata -----------------------------------------------------------------------------------------
