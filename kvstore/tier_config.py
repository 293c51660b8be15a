"""One tier's configuration, frozen and validated when built: cpu, disk, redis, remote.  How a tier spec
string or a TOML table becomes one is ``kvstore/config.py``."""

from __future__ import annotations

import re
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlsplit

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]i?b?|b)?\s*$", re.IGNORECASE)
FSYNC_POLICIES = ("never", "file", "always")
_ENDPOINT_RE = re.compile(r"^(tcp://[^\s:/]+:\d+|ipc://\S+|inproc://\S+)$")


def parse_size(text: Any, what: str = "size") -> int:
    """``"4GiB"`` -> 4294967296; ``ValueError`` naming ``what`` and the bad text otherwise."""
    if isinstance(text, int) and not isinstance(text, bool):
        if text <= 0:
            raise ValueError(f"{what} {text!r} must be positive")
        return text
    match = _SIZE_RE.match(str(text))
    if not match:
        raise ValueError(f"{what} {text!r} is not a size; use e.g. 4GiB, 512MiB, 64GB or a byte count")
    number, unit = match.group(1), (match.group(2) or "").lower()
    scale = 1 if unit in ("", "b") else (1024 if "i" in unit else 1000) ** ("kmgt".index(unit[0]) + 1)
    value = int(float(number) * scale)
    if value <= 0:
        raise ValueError(f"{what} {text!r} must be positive")
    return value


def parse_bool(text: Any, what: str) -> bool:
    if isinstance(text, bool):
        return text
    lowered = str(text).strip().lower()
    if lowered in ("1", "true", "yes", "on"):
        return True
    if lowered in ("0", "false", "no", "off"):
        return False
    raise ValueError(f"{what} {text!r} is not a boolean; use true or false")


def positive(value: Any, what: str, kind: Callable[[Any], Any] = float) -> Any:
    try:
        number = kind(value)
    except (TypeError, ValueError):
        raise ValueError(f"{what} {value!r} is not a number") from None
    if not number > 0:
        raise ValueError(f"{what} {value!r} must be positive")
    return number


@dataclass(frozen=True)
class CpuTierConfig:
    """In-process memory: ``capacity_bytes`` of payload, LRU; pinned when CUDA is present (``pin_memory``)."""

    capacity_bytes: int
    verify_payload: bool = False
    pin_memory: bool | None = None  # None: pin when torch sees a CUDA device
    name: str = "cpu"
    kind: str = field(default="cpu", init=False)

    def __post_init__(self) -> None:
        parse_size(self.capacity_bytes, "cpu tier capacity")


@dataclass(frozen=True)
class DiskTierConfig:
    """One directory, ``capacity_bytes`` of files, LRU; ``fsync``: never, file (before rename) or always
    (file and directory)."""

    path: str
    capacity_bytes: int
    fsync: str = "never"
    name: str = "disk"
    kind: str = field(default="disk", init=False)

    def __post_init__(self) -> None:
        if not self.path:
            raise ValueError("disk tier path must be a directory path, got ''")
        parse_size(self.capacity_bytes, "disk tier capacity")
        if self.fsync not in FSYNC_POLICIES:
            raise ValueError(
                f"disk tier fsync {self.fsync!r} is unknown; choose one of {', '.join(FSYNC_POLICIES)}"
            )


@dataclass(frozen=True)
class RedisTierConfig:
    """A Redis (or Valkey, or Redis Cluster) server; keys ``prefix:namespace:{anchor}:hash``."""

    url: str
    prefix: str = "pdkv"
    ttl_s: float | None = None
    timeout_s: float = 0.5
    connect_timeout_s: float = 0.25
    max_connections: int = 32
    cluster: bool = False
    batch: int = 16
    name: str = "redis"
    # Credentials and TLS, by reference: never the secret itself (see the module docstring).
    username: str | None = None
    password_env: str | None = None
    password_file: str | None = None
    ssl_ca_certs: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    kind: str = field(default="redis", init=False)

    def password(self) -> str | None:
        """The password password_env / password_file name, read now (None: none configured)."""
        import os

        if self.password_env:
            value = os.environ.get(self.password_env)
            if not value:
                raise ValueError(f"redis tier password_env: ${self.password_env} is not set")
            return value
        if self.password_file:
            try:
                with open(self.password_file, encoding="utf-8") as f:
                    return f.read().strip()
            except OSError as exc:
                raise ValueError(f"redis tier password_file {self.password_file}: {exc.strerror}") from None
        return None

    def __post_init__(self) -> None:
        parts = urlsplit(self.url)
        if parts.scheme not in ("redis", "rediss", "unix") or not (parts.hostname or parts.path):
            raise ValueError(f"redis tier url {self.url!r} must look like redis://host:port/db")
        if not self.prefix or any(c in self.prefix for c in "{}: "):
            raise ValueError(
                f"redis tier prefix {self.prefix!r} must be non-empty, without braces, colons or spaces"
            )
        if self.ttl_s is not None:
            positive(self.ttl_s, "redis tier ttl_s")
        positive(self.timeout_s, "redis tier timeout_s")
        positive(self.connect_timeout_s, "redis tier connect_timeout_s")
        positive(self.max_connections, "redis tier max_connections", int)
        positive(self.batch, "redis tier batch", int)
        if self.password_env and self.password_file:
            raise ValueError("redis tier: give password_env or password_file, not both")
        if (self.ssl_ca_certs or self.ssl_certfile) and parts.scheme != "rediss":
            raise ValueError("redis tier ssl_* options need a rediss:// url")
        if parts.scheme != "unix" and parts.path.strip("/") and not parts.path.strip("/").isdigit():
            raise ValueError(
                f"redis tier url {self.url!r}: the database after the port must be a number "
                f"(redis://host:port/0), got {parts.path.strip('/')!r}"
            )
        if self.cluster and parts.path.strip("/") not in ("", "0"):
            raise ValueError("a Redis Cluster has database 0 only: drop the /db from the url")
        if self.cluster and parts.scheme == "unix":
            raise ValueError(
                "a Redis Cluster is reached over TCP; drop cluster=true or use redis://host:port"
            )


@dataclass(frozen=True)
class RemoteTierConfig:
    """A ``pdkv kvstore serve`` process at ``endpoint`` (ZeroMQ)."""

    endpoint: str
    timeout_s: float = 1.0
    name: str = "remote"
    kind: str = field(default="remote", init=False)

    def __post_init__(self) -> None:
        if not _ENDPOINT_RE.match(self.endpoint):
            raise ValueError(
                f"remote tier endpoint {self.endpoint!r} must look like tcp://host:port or ipc:///path/to/socket"
            )
        positive(self.timeout_s, "remote tier timeout_s")
