"""Store configuration: one string (``--kv-store``) or a TOML table, parsed into frozen, validated configs.

The string is an ordered, comma-separated list of tiers, top (fastest) first:

    cpu:4GiB,disk:/var/cache/pdkv:64GiB,redis://host:6379/0
    cpu:1GiB,remote:tcp://127.0.0.1:7600

    cpu:SIZE[?verify=BOOL&pin=BOOL|auto&name=NAME]
    disk:PATH:SIZE[?fsync=never|file|always&name=NAME]
    redis://[user:password@]host:port[/db][?prefix=P&ttl_s=S&timeout_ms=MS&connect_timeout_ms=MS
                                          &max_connections=N&cluster=BOOL&batch=N&name=NAME
                                          &username=U&password_env=VAR&password_file=PATH
                                          &ssl_ca_certs=PATH&ssl_certfile=PATH&ssl_keyfile=PATH]
        (also rediss://, and valkey:// / valkeys:// as synonyms).  Credentials stay out of argv: the
        password is read from the environment variable password_env names, or from password_file; a
        password in the URL works but shows in ``ps``.  ssl_* (with rediss://) name the CA and client
        certificate files.
    remote:ENDPOINT[?timeout_ms=MS&name=NAME]      ENDPOINT = tcp://host:port | ipc://path

Sizes take B, KB/MB/GB/TB (powers of 1000) or KiB/MiB/GiB/TiB (powers of 1024), or a bare byte count.
The TOML form is a table with store-wide options and an array of tier tables (see ``docs/kvstore.md``):

    [kv_store]
    write_policy = "through"        # or "back": lower tiers receive blocks when an upper tier evicts them
    write_queue_depth = 1024
    lookup_timeout_ms = 50
    [[kv_store.tiers]]
    kind = "cpu"
    capacity = "4GiB"

Every error names the offending value and says what would be accepted.  Building tiers
(``kvstore.tiers.factory.build_tier``) imports a backend only when it is configured, so ``redis`` and
``zmq`` stay optional.
"""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass, field, fields, replace
from typing import Any, TypeAlias
from urllib.parse import parse_qsl, urlsplit, urlunsplit

from kvstore.breaker import BreakerConfig
from kvstore.tier_config import (
    CpuTierConfig,
    DiskTierConfig,
    RedisTierConfig,
    RemoteTierConfig,
    parse_bool,
    parse_size,
    positive,
)
from kvstore.tiers.base import TierPolicy

WRITE_POLICIES = ("through", "back")


TierConfig: TypeAlias = CpuTierConfig | DiskTierConfig | RedisTierConfig | RemoteTierConfig


@dataclass(frozen=True)
class StoreConfig:
    """A stack of tiers, top first, and the store-wide policy."""

    tiers: tuple[TierConfig, ...]
    write_policy: str = "through"
    write_queue_depth: int = 1024
    lookup_timeout_s: float = 0.05
    get_timeout_s: float = 2.0
    put_timeout_s: float = 2.0
    breaker: BreakerConfig = field(default_factory=BreakerConfig)

    def __post_init__(self) -> None:
        if not self.tiers:
            raise ValueError("a kv store needs at least one tier, e.g. cpu:4GiB")
        names = [t.name for t in self.tiers]
        dupes = sorted({n for n in names if names.count(n) > 1})
        if dupes:
            raise ValueError(
                f"tier names must be unique; {', '.join(dupes)} appears more than once (set name=...)"
            )
        _distinct_folders([t for t in self.tiers if isinstance(t, DiskTierConfig)])
        if self.write_policy not in WRITE_POLICIES:
            raise ValueError(
                f"write_policy {self.write_policy!r} is unknown; choose one of {', '.join(WRITE_POLICIES)}"
            )
        positive(self.write_queue_depth, "write_queue_depth", int)
        for name in ("lookup_timeout_s", "get_timeout_s", "put_timeout_s"):
            positive(getattr(self, name), name)

    @property
    def policy(self) -> TierPolicy:
        return TierPolicy(self.lookup_timeout_s, self.get_timeout_s, self.put_timeout_s, self.breaker)

    @classmethod
    def parse(cls, spec: str, **options: Any) -> StoreConfig:
        """The ``--kv-store`` string (module docstring); ``options`` set store-wide fields."""
        if not isinstance(spec, str) or not spec.strip():
            raise ValueError("--kv-store is empty; give tiers like cpu:4GiB,disk:/var/cache/pdkv:64GiB")
        tiers = [_parse_tier(part.strip(), i + 1) for i, part in enumerate(spec.split(","))]
        return cls(tuple(_unique_names(tiers)), **options)

    @classmethod
    def from_mapping(cls, table: Mapping[str, Any]) -> StoreConfig:
        """A parsed TOML table (``[kv_store]`` or its content)."""
        if "kv_store" in table and isinstance(table["kv_store"], Mapping):
            table = table["kv_store"]
        known = _TOML_STORE_FIELDS
        unknown = sorted(set(table) - known)
        if unknown:
            raise ValueError(
                f"kv_store: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}"
            )
        raw_tiers = table.get("tiers")
        if not isinstance(raw_tiers, list) or not raw_tiers:
            raise ValueError("kv_store.tiers must be a non-empty array of tables ([[kv_store.tiers]])")
        tiers = [_tier_from_mapping(t, i + 1) for i, t in enumerate(raw_tiers)]
        breaker = BreakerConfig(
            failures_to_open=int(table.get("breaker_failures", 1)),
            cooldown_s=positive(table.get("breaker_cooldown_ms", 1000), "breaker_cooldown_ms") / 1000,
            max_cooldown_s=positive(table.get("breaker_max_cooldown_ms", 30000), "breaker_max_cooldown_ms")
            / 1000,
        )
        return cls(
            tuple(_unique_names(tiers)),
            write_policy=str(table.get("write_policy", "through")),
            write_queue_depth=positive(table.get("write_queue_depth", 1024), "write_queue_depth", int),
            lookup_timeout_s=positive(table.get("lookup_timeout_ms", 50), "lookup_timeout_ms") / 1000,
            get_timeout_s=positive(table.get("get_timeout_ms", 2000), "get_timeout_ms") / 1000,
            put_timeout_s=positive(table.get("put_timeout_ms", 2000), "put_timeout_ms") / 1000,
            breaker=breaker,
        )

    @classmethod
    def from_toml(cls, text: str) -> StoreConfig:
        return cls.from_mapping(tomllib.loads(text))

    @classmethod
    def load(cls, spec: str) -> StoreConfig:
        """``@path/to/file.toml`` reads a TOML file; anything else is a ``--kv-store`` string."""
        if spec.startswith("@"):
            with open(spec[1:], encoding="utf-8") as f:
                return cls.from_toml(f.read())
        return cls.parse(spec)


# ---- the string form ----------------------------------------------------------------------------------


def _distinct_folders(disks: list[DiskTierConfig]) -> None:
    """Two disk tiers in one folder would index, evict and delete each other's files: refused by name (a
    folder inside another's is its own: a tier reads only its namespace folders)."""
    seen: dict[str, str] = {}
    for t in disks:
        path = os.path.realpath(t.path)
        if path in seen:
            raise ValueError(
                f"disk tiers {seen[path]!r} and {t.name!r} share the folder {path}; give each its own"
            )
        seen[path] = t.name


def _split_options(text: str, where: str) -> tuple[str, dict[str, str]]:
    head, sep, query = text.partition("?")
    if not sep:
        return head, {}
    options: dict[str, str] = {}
    for pair in query.split("&"):
        key, eq, value = pair.partition("=")
        if not eq or not key:
            raise ValueError(f"{where}: option {pair!r} must be key=value")
        options[key] = value
    return head, options


def _take(options: dict[str, str], allowed: set[str], where: str) -> dict[str, str]:
    unknown = sorted(set(options) - allowed)
    if unknown:
        raise ValueError(
            f"{where}: unknown option(s) {', '.join(unknown)}; known: {', '.join(sorted(allowed))}"
        )
    return options


def _parse_tier(text: str, index: int) -> TierConfig:
    where = f"--kv-store tier {index} {text!r}"
    try:
        return _parse_tier_text(text, where)
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if message.startswith(where) else f"{where}: {message}") from None


def _parse_tier_text(text: str, where: str) -> TierConfig:
    if not text:
        raise ValueError(f"{where}: empty tier (two commas in a row?)")
    kind, _, rest = text.partition(":")
    kind = kind.lower()
    if kind == "cpu":
        size, options = _split_options(rest, where)
        opts = _take(options, {"verify", "pin", "name"}, where)
        pin = opts.get("pin", "auto")
        return CpuTierConfig(
            capacity_bytes=parse_size(size, "capacity"),
            verify_payload=parse_bool(opts.get("verify", "false"), "verify"),
            pin_memory=None if pin == "auto" else parse_bool(pin, "pin"),
            name=opts.get("name", "cpu"),
        )
    if kind == "disk":
        body, options = _split_options(rest, where)
        path, colon, size = body.rpartition(":")
        if not colon or not path:
            raise ValueError(f"{where}: a disk tier is disk:PATH:SIZE, e.g. disk:/var/cache/pdkv:64GiB")
        opts = _take(options, {"fsync", "name"}, where)
        return DiskTierConfig(
            path=path,
            capacity_bytes=parse_size(size, "capacity"),
            fsync=opts.get("fsync", "never"),
            name=opts.get("name", "disk"),
        )
    if kind in ("redis", "rediss", "valkey", "valkeys", "unix"):
        return _parse_redis(text, where)
    if kind == "remote":
        endpoint, options = _split_options(rest, where)
        opts = _take(options, {"timeout_ms", "name"}, where)
        return RemoteTierConfig(
            endpoint=endpoint,
            timeout_s=positive(opts.get("timeout_ms", 1000), "timeout_ms") / 1000,
            name=opts.get("name", "remote"),
        )
    raise ValueError(
        f"{where}: unknown tier kind {kind!r}; use cpu:SIZE, disk:PATH:SIZE, redis://... or remote:tcp://..."
    )


_REDIS_OPTIONS = {
    "prefix",
    "ttl_s",
    "timeout_ms",
    "connect_timeout_ms",
    "max_connections",
    "cluster",
    "batch",
    "name",
    "username",
    "password_env",
    "password_file",
    "ssl_ca_certs",
    "ssl_certfile",
    "ssl_keyfile",
}


def _parse_redis(text: str, where: str) -> RedisTierConfig:
    parts = urlsplit(text)
    scheme = {"valkey": "redis", "valkeys": "rediss"}.get(parts.scheme, parts.scheme)
    ours: dict[str, str] = {}
    passthrough: list[tuple[str, str]] = []
    for key, value in parse_qsl(parts.query, keep_blank_values=True):
        (ours.__setitem__(key, value) if key in _REDIS_OPTIONS else passthrough.append((key, value)))
    if passthrough:
        names = ", ".join(k for k, _ in passthrough)
        raise ValueError(f"{where}: unknown option(s) {names}; known: {', '.join(sorted(_REDIS_OPTIONS))}")
    url = urlunsplit((scheme, parts.netloc, parts.path, "", ""))
    try:
        port = parts.port
    except ValueError:
        raise ValueError(f"{where}: port in {parts.netloc!r} is not a number") from None
    if scheme != "unix" and not parts.hostname:
        raise ValueError(f"{where}: a redis url needs a host, e.g. redis://127.0.0.1:6379/0")
    del port  # checked above; a missing port means 6379
    return RedisTierConfig(
        url=url,
        prefix=ours.get("prefix", "pdkv"),
        ttl_s=positive(ours["ttl_s"], "ttl_s") if "ttl_s" in ours else None,
        timeout_s=positive(ours.get("timeout_ms", 500), "timeout_ms") / 1000,
        connect_timeout_s=positive(ours.get("connect_timeout_ms", 250), "connect_timeout_ms") / 1000,
        max_connections=positive(ours.get("max_connections", 32), "max_connections", int),
        cluster=parse_bool(ours.get("cluster", "false"), "cluster"),
        batch=positive(ours.get("batch", 16), "batch", int),
        name=ours.get("name", "redis"),
        username=ours.get("username") or None,
        password_env=ours.get("password_env") or None,
        password_file=ours.get("password_file") or None,
        ssl_ca_certs=ours.get("ssl_ca_certs") or None,
        ssl_certfile=ours.get("ssl_certfile") or None,
        ssl_keyfile=ours.get("ssl_keyfile") or None,
    )


# ---- the TOML form ----

_TOML_STORE_FIELDS = frozenset(
    {
        "tiers",
        "write_policy",
        "write_queue_depth",
        "lookup_timeout_ms",
        "get_timeout_ms",
        "put_timeout_ms",
        "breaker_failures",
        "breaker_cooldown_ms",
        "breaker_max_cooldown_ms",
    }
)
_TOML_TIER_FIELDS: dict[str, set[str]] = {
    "cpu": {"kind", "capacity", "verify", "pin", "name"},
    "disk": {"kind", "path", "capacity", "fsync", "name"},
    "redis": {"kind", "url", *_REDIS_OPTIONS},
    "remote": {"kind", "endpoint", "timeout_ms", "name"},
}


def _tier_from_mapping(table: Any, index: int) -> TierConfig:
    where = f"kv_store.tiers[{index}]"
    if not isinstance(table, Mapping):
        raise ValueError(f"{where} must be a table with a kind, got {table!r}")
    kind = str(table.get("kind", ""))
    if kind not in _TOML_TIER_FIELDS:
        raise ValueError(f"{where}: kind {kind!r} is unknown; choose one of {', '.join(_TOML_TIER_FIELDS)}")
    unknown = sorted(set(table) - _TOML_TIER_FIELDS[kind])
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(unknown)} for a {kind} tier")
    try:
        if kind == "cpu":
            pin = table.get("pin", "auto")
            return CpuTierConfig(
                capacity_bytes=parse_size(table.get("capacity"), "capacity"),
                verify_payload=parse_bool(table.get("verify", False), "verify"),
                pin_memory=None if pin == "auto" else parse_bool(pin, "pin"),
                name=str(table.get("name", "cpu")),
            )
        if kind == "disk":
            return DiskTierConfig(
                path=str(table.get("path", "")),
                capacity_bytes=parse_size(table.get("capacity"), "capacity"),
                fsync=str(table.get("fsync", "never")),
                name=str(table.get("name", "disk")),
            )
        if kind == "redis":
            options = "&".join(f"{k}={_toml_scalar(v)}" for k, v in table.items() if k not in ("kind", "url"))
            url = str(table.get("url", ""))
            return _parse_redis(url + ("?" + options if options else ""), where)
        query = "&".join(f"{k}={v}" for k, v in table.items() if k not in ("kind", "endpoint"))
        return _parse_tier_text(f"remote:{table.get('endpoint', '')}" + ("?" + query if query else ""), where)
    except ValueError as exc:
        message = str(exc)
        raise ValueError(message if message.startswith(where) else f"{where}: {message}") from None


def _toml_scalar(value: Any) -> str:
    return str(value).lower() if isinstance(value, bool) else str(value)


def _unique_names(tiers: list[TierConfig]) -> list[TierConfig]:
    """Give a repeated default name a numeric suffix (``disk``, ``disk-2``); explicit names stay."""
    seen: dict[str, int] = {}
    out: list[TierConfig] = []
    for tier in tiers:
        seen[tier.name] = seen.get(tier.name, 0) + 1
        if seen[tier.name] > 1 and tier.name == tier.kind:
            tier = replace(tier, name=f"{tier.name}-{seen[tier.name]}")
        out.append(tier)
    return out


def config_fields(config: TierConfig) -> dict[str, Any]:
    """A tier config as a plain dict (for logs and ``stats``)."""
    return {f.name: getattr(config, f.name) for f in fields(config)}
