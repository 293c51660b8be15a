"""Transfer parameters signed by the prefill node and checked by the decode node.

A decode node pulls a prompt's KV from wherever ``kv_transfer_params`` say.  Unsigned, anyone who can
call ``DecodeNode/Decode`` can make it pull from a producer of their choosing.  With a cluster secret
(``--cluster-secret-file`` or ``$PDKV_CLUSTER_SECRET``; never argv) the prefill node seals its params::

    msgpack {"v": 1, "params": <the connector's params, msgpack>, "exp": <unix time>, "mac": <32 bytes>}
    mac = HMAC-SHA256(secret, "pdkv-transfer-v1" | request id | sha256(prompt ids) | salt | first token
                              | exp | params)

and a decode node with the secret opens them: a wrong mac, a different request / prompt / salt / first
token, an expired seal or unsealed params are refused (PERMISSION_DENIED) before any pull, so the node
pulls only from producers a prefill node of its cluster vouched for, for that very request.
"""

from __future__ import annotations

import hashlib
import hmac
import os
import struct
import time
from collections.abc import Mapping, Sequence
from pathlib import Path

import grpc
import msgpack

from serving.errors import ServingError

SECRET_ENV = "PDKV_CLUSTER_SECRET"
SECRET_FILE_ENV = "PDKV_CLUSTER_SECRET_FILE"
MIN_SECRET_BYTES = 16
DOMAIN = b"pdkv-transfer-v1"
# Long enough for a queued decode; a seal older than this is refused (the producer's lease is shorter).
DEFAULT_TTL_S = 600.0


def load_cluster_secret(path: str | None, environ: Mapping[str, str] | None = None) -> bytes | None:
    """The cluster secret from ``path`` (else ``$PDKV_CLUSTER_SECRET_FILE``), else
    ``$PDKV_CLUSTER_SECRET``; None when none is set.  Too short a secret is refused."""
    env = os.environ if environ is None else environ
    path = path or env.get(SECRET_FILE_ENV) or None
    if path:
        try:
            secret = Path(path).read_bytes().strip()
        except OSError as exc:
            raise ValueError(f"the cluster secret file {path} cannot be read: {exc.strerror}") from None
        where = f"the cluster secret file {path}"
    elif env.get(SECRET_ENV):
        secret, where = env[SECRET_ENV].encode(), f"${SECRET_ENV}"
    else:
        return None
    if len(secret) < MIN_SECRET_BYTES:
        raise ValueError(
            f"{where} holds {len(secret)} bytes; a cluster secret needs at least {MIN_SECRET_BYTES}"
        )
    return secret


class TransferSigner:
    """Seals (prefill) and opens (decode) ``kv_transfer_params`` with the cluster secret."""

    def __init__(self, secret: bytes, ttl_s: float = DEFAULT_TTL_S) -> None:
        if len(secret) < MIN_SECRET_BYTES:
            raise ValueError(f"a cluster secret needs at least {MIN_SECRET_BYTES} bytes")
        self._key = hmac.new(secret, DOMAIN, hashlib.sha256).digest()  # a key of its own for this use
        self.ttl_s = ttl_s

    def seal(
        self,
        params: bytes,
        request_id: str,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None,
        first_token_id: int,
        *,
        now: float | None = None,
    ) -> bytes:
        if not params:
            return b""
        exp = int((time.time() if now is None else now) + self.ttl_s)
        mac = self._mac(params, request_id, prompt_token_ids, cache_salt, first_token_id, exp)
        return msgpack.packb({"v": 1, "params": params, "exp": exp, "mac": mac}, use_bin_type=True)  # type: ignore[no-any-return]

    def open(
        self,
        sealed: bytes,
        request_id: str,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None,
        first_token_id: int | None,
        *,
        now: float | None = None,
    ) -> bytes:
        """The params inside ``sealed``; PERMISSION_DENIED unless a holder of the secret sealed them for
        exactly this request."""
        if not sealed:
            return b""
        try:
            envelope = msgpack.unpackb(sealed, raw=False)
        except (ValueError, msgpack.UnpackException):
            envelope = None
        if not (
            isinstance(envelope, dict)
            and envelope.get("v") == 1
            and isinstance(envelope.get("params"), bytes)
            and isinstance(envelope.get("exp"), int)
            and isinstance(envelope.get("mac"), bytes)
        ):
            raise _denied("are not sealed by a prefill node of this cluster (pass PrefillResponse's bytes)")
        if first_token_id is None:
            raise _denied("need the first_token_id they were sealed with")
        params, exp = envelope["params"], envelope["exp"]
        expected = self._mac(params, request_id, prompt_token_ids, cache_salt, first_token_id, exp)
        if not hmac.compare_digest(expected, envelope["mac"]):
            raise _denied("carry a seal that does not match this request (or the cluster secret)")
        if (time.time() if now is None else now) > exp:
            raise _denied(f"expired {self.ttl_s:.0f}s after the prefill node sealed them")
        return params  # type: ignore[no-any-return]

    def _mac(
        self,
        params: bytes,
        request_id: str,
        prompt_token_ids: Sequence[int],
        cache_salt: str | None,
        first_token_id: int,
        exp: int,
    ) -> bytes:
        prompt = hashlib.sha256(struct.pack(f"<{len(prompt_token_ids)}I", *prompt_token_ids)).digest()
        salt = b"\x00" if cache_salt is None else b"\x01" + cache_salt.encode()
        fields = (request_id.encode(), prompt, salt, struct.pack("<Iq", first_token_id, exp), params)
        mac = hmac.new(self._key, digestmod=hashlib.sha256)
        for f in fields:  # length-prefixed: no two field lists give one byte string
            mac.update(struct.pack("<I", len(f)))
            mac.update(f)
        return mac.digest()


def _denied(why: str) -> ServingError:
    return ServingError(grpc.StatusCode.PERMISSION_DENIED, f"kv_transfer_params {why}")
