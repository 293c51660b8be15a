"""Who may call the router, as which tenant, and how much of it one caller may take.

Open (no API keys: loopback, one trust domain)::

    every caller is the tenant "" -- its cache salt is the one it sends; a gRPC connection is one client
    (``client_max_inflight`` calls at most)

With API keys (``--api-keys-file`` or ``$PDKV_API_KEYS``; never argv)::

    authorization: Bearer KEY   (gRPC metadata, or the HTTP header)   -> the key's tenant, else 401
    cache salt                  "TENANT" or "TENANT/CLIENT_SALT": decided here, so no client reaches
                                another tenant's cached prefixes, whatever salt it sends
    calls in flight             at most the tenant's ``max_inflight`` (default ``client_max_inflight``)
    cached-token details        in the usage only where the operator enabled them
    adapter loads / unloads     only tenants with ``manage_adapters = true`` (one tenant's load would
                                replace or remove an adapter every other tenant runs)

The keys file (TOML; keep it 0600)::

    [tenants.acme]
    keys = ["sk-..."]                 # or key_sha256 = ["<hex digest>"], so the file holds no secret
    max_inflight = 32                 # optional
    cache_details = true              # optional: show this tenant its cached-token counts
    manage_adapters = true            # optional: may load and unload LoRA adapters (--allow-runtime-lora)

``$PDKV_API_KEYS`` holds ``KEY=TENANT`` pairs, comma-separated.  Keys are kept as SHA-256 digests and
looked up by digest.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import re
import threading
import tomllib
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import grpc

from serving.errors import ServingError

KEYS_ENV = "PDKV_API_KEYS"
KEYS_FILE_ENV = "PDKV_API_KEYS_FILE"
TENANT_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")
MIN_KEY_LEN = 16


@dataclass(frozen=True)
class Tenant:
    """Who a caller is.  ``name`` "" is the open router's one tenant."""

    name: str
    max_inflight: int | None = None  # None: the router's client_max_inflight
    cache_details: bool | None = None  # None: the router's cache_details
    manage_adapters: bool = False  # may load and unload adapters (every tenant's, by name)

    def salt(self, client_salt: str | None, key: bytes | None = None) -> str | None:
        """The cache salt a request of this tenant hashes with.  ``key`` (the router's salt key): the
        tenant's part is keyed, so whoever sees block hashes (KV events) cannot recompute them for a
        guessed prompt of a tenant whose name they know."""
        if not self.name:
            return client_salt
        tag = self.name
        if key is not None:
            tag = f"{self.name}-{hmac.new(key, self.name.encode(), hashlib.sha256).hexdigest()[:32]}"
        return tag if client_salt is None else f"{tag}/{client_salt}"


OPEN = Tenant("")


@dataclass(frozen=True)
class Caller:
    """An authenticated call: its tenant, the key it is counted under, and what it may see."""

    tenant: Tenant
    client: str  # admission key: the tenant, or (open) the connection
    max_inflight: int
    cache_details: bool
    salt_key: bytes | None = None

    def salt(self, client_salt: str | None) -> str | None:
        return self.tenant.salt(client_salt, self.salt_key)

    def may_manage_adapters(self) -> None:
        """PERMISSION_DENIED unless this caller may load and unload adapters: the open router's one
        tenant, or a tenant the keys file gives ``manage_adapters = true``."""
        if self.tenant.name and not self.tenant.manage_adapters:
            raise ServingError(
                grpc.StatusCode.PERMISSION_DENIED,
                f"tenant {self.tenant.name!r} may not load or unload adapters (the keys file's "
                "manage_adapters = true allows it)",
            )


class Access:
    """API keys -> tenants, and the per-client admission books."""

    def __init__(
        self,
        digests: Mapping[str, Tenant] | None = None,
        *,
        client_max_inflight: int = 128,
        cache_details: bool = False,
        salt_key: bytes | None = None,
    ) -> None:
        """``digests``: ``key_digest(key)`` -> the key's tenant; none = open.  ``salt_key``: keys the
        tenants' salts (derived from the cluster secret where the router has one)."""
        if client_max_inflight <= 0:
            raise ValueError(f"client_max_inflight must be positive, got {client_max_inflight}")
        self._by_digest = dict(digests or {})
        self.client_max_inflight = client_max_inflight
        self.cache_details = cache_details
        self.salt_key = salt_key
        self._inflight: dict[str, int] = {}
        self._lock = threading.Lock()

    @property
    def open(self) -> bool:
        """No API keys: anyone who reaches the router may call it."""
        return not self._by_digest

    @property
    def tenants(self) -> list[str]:
        return sorted({t.name for t in self._by_digest.values()})

    def authenticate(self, authorization: str | None, peer: str = "") -> Caller:
        """The caller behind an ``authorization`` header (``Bearer KEY``); UNAUTHENTICATED when keys are
        required and it names none of them.  ``peer`` is the open router's admission key."""
        if self.open:
            return Caller(OPEN, f"peer:{peer}", self.client_max_inflight, self.cache_details)
        if not authorization:
            raise ServingError(
                grpc.StatusCode.UNAUTHENTICATED,
                "an API key is required: send 'authorization: Bearer <key>'",
            )
        scheme, _, key = authorization.strip().partition(" ")
        if scheme.lower() != "bearer" or not key.strip():
            raise ServingError(
                grpc.StatusCode.UNAUTHENTICATED, "the authorization header must be 'Bearer <key>'"
            )
        tenant = self._by_digest.get(key_digest(key.strip()))
        if tenant is None:
            raise ServingError(grpc.StatusCode.UNAUTHENTICATED, "the API key is not valid")
        limit = tenant.max_inflight if tenant.max_inflight is not None else self.client_max_inflight
        details = tenant.cache_details if tenant.cache_details is not None else self.cache_details
        return Caller(tenant, f"tenant:{tenant.name}", limit, details, self.salt_key)

    @contextmanager
    def admitted(self, caller: Caller) -> Iterator[None]:
        """Count one call of ``caller`` while the block runs; RESOURCE_EXHAUSTED past its limit."""
        with self._lock:
            n = self._inflight.get(caller.client, 0)
            if n >= caller.max_inflight:
                who = f"tenant {caller.tenant.name!r}" if caller.tenant.name else "this connection"
                raise ServingError(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"{who} already has {n} requests in flight (its limit is {caller.max_inflight}); "
                    "retry later",
                )
            self._inflight[caller.client] = n + 1
        try:
            yield
        finally:
            with self._lock:
                left = self._inflight[caller.client] - 1
                if left:
                    self._inflight[caller.client] = left
                else:
                    del self._inflight[caller.client]

    def inflight(self, client: str) -> int:
        with self._lock:
            return self._inflight.get(client, 0)


def load_access(
    keys_file: str | None,
    *,
    environ: Mapping[str, str] | None = None,
    client_max_inflight: int = 128,
    cache_details: bool = False,
    cluster_secret: bytes | None = None,
) -> Access:
    """The router's ``Access`` from a keys file (``keys_file``, else ``$PDKV_API_KEYS_FILE``) and/or
    ``$PDKV_API_KEYS``; open when neither names a key."""
    env = os.environ if environ is None else environ
    digests: dict[str, Tenant] = {}
    path = keys_file or env.get(KEYS_FILE_ENV) or None
    if path:
        digests.update(_read_keys_file(Path(path)))
    for pair in filter(None, (p.strip() for p in env.get(KEYS_ENV, "").split(","))):
        key, sep, name = pair.rpartition("=")
        if not sep or not key:
            raise ValueError(f"${KEYS_ENV}: each entry is KEY=TENANT, got one without '='")
        _check_key(key, f"${KEYS_ENV}")
        digests[key_digest(key)] = Tenant(_tenant_name(name, f"${KEYS_ENV}"))
    salt_key = (
        hmac.new(cluster_secret, b"pdkv-tenant-salt", hashlib.sha256).digest() if cluster_secret else None
    )
    return Access(
        digests, client_max_inflight=client_max_inflight, cache_details=cache_details, salt_key=salt_key
    )


def _read_keys_file(path: Path) -> dict[str, Tenant]:
    try:
        data = tomllib.loads(path.read_text())
    except OSError as exc:
        raise ValueError(f"the API keys file {path} cannot be read: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ValueError(f"the API keys file {path} is not valid TOML: {exc}") from None
    tenants = data.get("tenants")
    if not isinstance(tenants, dict) or not tenants:
        raise ValueError(f"the API keys file {path} names no [tenants.NAME] table")
    out: dict[str, Tenant] = {}
    for name, table in tenants.items():
        where = f"{path}: tenants.{name}"
        if not isinstance(table, dict):
            raise ValueError(f"{where} must be a table")
        unknown = set(table) - {"keys", "key_sha256", "max_inflight", "cache_details", "manage_adapters"}
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
        limit = table.get("max_inflight")
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool) or limit <= 0):
            raise ValueError(f"{where}.max_inflight must be a positive integer")
        details = table.get("cache_details")
        if details is not None and not isinstance(details, bool):
            raise ValueError(f"{where}.cache_details must be true or false")
        manage = table.get("manage_adapters", False)
        if not isinstance(manage, bool):
            raise ValueError(f"{where}.manage_adapters must be true or false")
        tenant = Tenant(_tenant_name(name, where), limit, details, manage)
        keys = table.get("keys", [])
        hashed = table.get("key_sha256", [])
        if not isinstance(keys, list) or not isinstance(hashed, list) or not (keys or hashed):
            raise ValueError(f"{where} needs keys = [...] or key_sha256 = [...]")
        digests = []
        for key in keys:
            _check_key(key, where)
            digests.append(key_digest(key))
        for digest in hashed:
            if not isinstance(digest, str) or not re.fullmatch(r"[0-9a-f]{64}", digest):
                raise ValueError(f"{where}.key_sha256 holds something that is not a sha256 hex digest")
            digests.append(digest)
        for digest in digests:
            if digest in out:
                raise ValueError(
                    f"{where}: a key is listed twice (also under tenant {out[digest].name!r}); a key "
                    "names one tenant"
                )
            out[digest] = tenant
    return out


def _check_key(key: object, where: str) -> None:
    if not isinstance(key, str) or len(key) < MIN_KEY_LEN or not key.isprintable() or " " in key:
        raise ValueError(
            f"{where}: an API key must be at least {MIN_KEY_LEN} printable characters, no spaces"
        )


def _tenant_name(name: str, where: str) -> str:
    if not TENANT_NAME.fullmatch(name):
        raise ValueError(f"{where}: tenant name {name!r} must match {TENANT_NAME.pattern}")
    return name


def key_digest(key: str) -> str:
    """What a keys file's ``key_sha256`` holds for ``key`` (and what ``Access`` looks keys up by)."""
    return hashlib.sha256(key.encode()).hexdigest()
